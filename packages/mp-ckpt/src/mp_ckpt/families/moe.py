"""Mixture-of-experts rules shared by the families that have experts.

mp's MoE layer i (under decoder.layers.{i}.mlp.; E experts of width F, hidden h,
a shared expert of width S):

    router.weight                              [E, h]
    router.expert_bias                         [E]         (DeepSeek-V3: its buffer)
    experts.linear_fc1.gate.weight             [E, F, h]   dim 0: the expert
    experts.linear_fc1.up.weight               [E, F, h]
    experts.linear_fc2.weight                  [E, h, F]
    shared_experts.linear_fc1.{gate,up}.weight [S, h]      (Qwen2-MoE, DeepSeek)
    shared_experts.linear_fc2.weight           [h, S]
    shared_experts.gate_weight                 [1, h]      (Qwen2-MoE)

Hugging Face saves experts one by one (hub checkpoints, and transformers 5's
save_pretrained): `{block}.experts.{e}.{gate,up,down}.weight`, which `expert_rules`
names. transformers 5's in-memory state dict fuses them instead:
`mlp.experts.gate_up_proj` [E, 2F, h] (the F gate rows, then the F up rows) and
`mlp.experts.down_proj` [E, h, F]; `unfuse_experts` rewrites that form into the saved
one before import, so either imports.
"""

from __future__ import annotations

import re

from mp_ckpt.families.table import Rule, is_moe_layer

__all__ = ["expert_rules", "is_moe_layer", "shared_expert_rules", "unfuse_experts"]


def expert_rules(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """The router and the per-expert projections of a Llama-style MoE block
    (model.layers.{i}.<block>.gate.weight, <block>.experts.{e}.<gate|up|down>.weight)."""
    layer = f"model.layers.{{i}}.{block}."
    return (
        Rule(("mlp.router.weight",), layer + "gate.weight", "moe"),
        Rule(("mlp.experts.linear_fc1.gate.weight",), layer + f"experts.{{e}}.{gate}.weight",
             "moe", megatron="mlp.experts.experts.linear_fc1"),
        Rule(("mlp.experts.linear_fc1.up.weight",), layer + f"experts.{{e}}.{up}.weight",
             "moe", megatron="mlp.experts.experts.linear_fc1"),
        Rule(("mlp.experts.linear_fc2.weight",), layer + f"experts.{{e}}.{down}.weight",
             "moe", megatron="mlp.experts.experts.linear_fc2"),
    )  # fmt: skip


def shared_expert_rules(module: str = "shared_expert", *, gated: bool = True,
                        block: str = "mlp") -> tuple[Rule, ...]:  # fmt: skip
    """The shared expert under model.layers.{i}.<block>.<module>: Qwen2-MoE's (gated by
    shared_expert_gate), DeepSeek's ("shared_experts", ungated), Llama 4's (ungated, under
    "feed_forward")."""
    layer = f"model.layers.{{i}}.{block}."
    names = (("linear_fc1.gate", "gate_proj"), ("linear_fc1.up", "up_proj"),
             ("linear_fc2", "down_proj"))  # fmt: skip
    rules = tuple(
        Rule((f"mlp.shared_experts.{ours}.weight",), f"{layer}{module}.{theirs}.weight",
             "moe", megatron="mlp.shared_experts.linear_fc1" if "fc1" in ours else None)
        for ours, theirs in names
    )  # fmt: skip
    if not gated:
        return rules
    return (*rules, Rule(("mlp.shared_experts.gate_weight",), layer + "shared_expert_gate.weight",
                         "moe"))  # fmt: skip


_FUSED = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)$")


def unfuse_experts(block: str, gate: str, up: str, down: str):
    """A `prepare` hook: transformers' fused in-memory experts -> the per-expert names."""

    def prepare(state: dict, config: dict) -> dict:
        out = {}
        for name, tensor in state.items():
            match = _FUSED.match(name)
            if match is None:
                out[name.replace(".mlp.gate.weight", f".{block}.gate.weight")
                    if block != "mlp" else name] = tensor  # fmt: skip
                continue
            prefix = f"{match.group(1)}{block}.experts."
            if match.group(2) == "down_proj":
                parts = {down: tensor}
            else:
                if tensor.shape[1] % 2:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} is not [E, 2F, h]")
                parts = dict(zip((gate, up), tensor.chunk(2, dim=1), strict=True))
            for theirs, stacked in parts.items():
                for e, one in enumerate(stacked.unbind(0)):
                    out[f"{prefix}{e}.{theirs}.weight"] = one
        return out

    return prepare
