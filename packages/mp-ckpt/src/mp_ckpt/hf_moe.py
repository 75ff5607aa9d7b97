"""Mixtral's and Qwen2-MoE's expert tensors <-> mp's logical MoE tensors.

mp's MoE layer i (under decoder.layers.{i}.mlp.; E experts of width F, hidden h,
a shared expert of width S):

    router.weight                              [E, h]
    experts.linear_fc1.gate.weight             [E, F, h]   dim 0: the expert
    experts.linear_fc1.up.weight               [E, F, h]
    experts.linear_fc2.weight                  [E, h, F]
    shared_experts.linear_fc1.{gate,up}.weight [S, h]      (Qwen2-MoE)
    shared_experts.linear_fc2.weight           [h, S]
    shared_experts.gate_weight                 [1, h]

Hugging Face holds the same weights in one of two layouts, under model.layers.{i}.:

  per expert (hub checkpoints, and what transformers 5's save_pretrained writes):
    Mixtral     block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1/w3/w2.weight
                (w1 the gate projection, w3 the up projection, w2 the down projection)
    Qwen2-MoE   mlp.gate.weight, mlp.experts.{e}.gate_proj/up_proj/down_proj.weight,
                mlp.shared_expert.gate_proj/up_proj/down_proj.weight,
                mlp.shared_expert_gate.weight
  fused (transformers 5's in-memory state dict; Mixtral's block renamed mlp):
    mlp.gate.weight, mlp.experts.gate_up_proj [E, 2F, h] (the F gate rows, then the
    F up rows: the experts compute chunk(2) of it as gate, up), mlp.experts.down_proj
    [E, h, F], and Qwen2-MoE's shared expert as above.

import_moe_mlp reads either; export_moe_mlp writes the per-expert layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from mp_ckpt.regions import Region

__all__ = ["export_moe_mlp", "import_moe_mlp", "is_moe_layer", "moe_mlp_keys"]

_OURS = ("linear_fc1.gate", "linear_fc1.up", "linear_fc2")
# Each expert's (gate, up, down) projections, per architecture.
_THEIRS = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}
_BLOCKS = {"mixtral": ("block_sparse_moe", "mlp"), "qwen2_moe": ("mlp",)}


def is_moe_layer(settings: dict, i: int) -> bool:
    """Whether layer i is a mixture of experts under the settings' moe_layer_freq, read as
    TransformerConfig reads it: N or [N] (with more than one layer) for every N-th layer
    from layer 0, else a 0/1 entry per layer."""
    if settings.get("num_moe_experts") is None:
        return False
    freq = settings.get("moe_layer_freq", [1])
    freq = [freq] if isinstance(freq, int) else list(freq)
    if len(freq) == 1 and settings["num_layers"] > 1:
        return i % freq[0] == 0
    return bool(freq[i])


def moe_mlp_keys(shared: bool) -> list[str]:
    """The logical tensors of an MoE layer, under decoder.layers.{i}."""
    keys = ["mlp.router.weight"] + [f"mlp.experts.{ours}.weight" for ours in _OURS]
    if shared:
        keys += [f"mlp.shared_experts.{ours}.weight" for ours in _OURS]
        keys.append("mlp.shared_experts.gate_weight")
    return keys


def _need(state: dict, name: str) -> torch.Tensor:
    if name not in state:
        raise KeyError(f"the Hugging Face weights have no tensor {name!r}")
    return state[name]


def import_moe_mlp(state: dict, arch: str, src: str, experts: int,
                   shared: bool) -> dict[str, torch.Tensor]:  # fmt: skip
    """Layer `src`'s (model.layers.{i}.) expert tensors under mp's names, relative to
    decoder.layers.{i}., from either layout."""
    block = next((b for b in _BLOCKS[arch] if f"{src}{b}.gate.weight" in state), _BLOCKS[arch][0])
    prefix = f"{src}{block}."
    router = _need(state, prefix + "gate.weight")
    if router.shape[0] != experts:
        raise ValueError(
            f"{prefix}gate.weight has {router.shape[0]} experts; config.json says {experts}"
        )
    out = {"mlp.router.weight": router}
    fused = prefix + "experts.gate_up_proj"
    if fused in state:
        gate_up = state[fused]
        if gate_up.shape[0] != experts or gate_up.shape[1] % 2:
            raise ValueError(f"{fused}: shape {tuple(gate_up.shape)} is not [{experts}, 2F, h]")
        gate, up = gate_up.chunk(2, dim=1)
        down = _need(state, prefix + "experts.down_proj")
    else:
        gate, up, down = (
            torch.stack(
                [_need(state, f"{prefix}experts.{e}.{name}.weight") for e in range(experts)]
            )
            for name in _THEIRS[arch]
        )
    for ours, tensor in zip(_OURS, (gate, up, down), strict=True):
        out[f"mlp.experts.{ours}.weight"] = tensor.contiguous()
    if shared:
        for ours, theirs in zip(_OURS, _THEIRS["qwen2_moe"], strict=True):
            out[f"mlp.shared_experts.{ours}.weight"] = _need(
                state, f"{prefix}shared_expert.{theirs}.weight")  # fmt: skip
        out["mlp.shared_experts.gate_weight"] = _need(state, prefix + "shared_expert_gate.weight")
    return out


def export_moe_mlp(reader, arch: str, src: str, dst: str, experts: int,
                   shared: bool) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:  # fmt: skip
    """(Hugging Face name, producer) of layer src's (decoder.layers.{i}.) expert tensors
    in the per-expert layout under dst (model.layers.{i}.); one expert read at a time."""
    block = f"{dst}{_BLOCKS[arch][0]}."
    yield block + "gate.weight", lambda: reader.read(src + "mlp.router.weight")
    for e in range(experts):
        for ours, theirs in zip(_OURS, _THEIRS[arch], strict=True):
            key = f"{src}mlp.experts.{ours}.weight"
            yield f"{block}experts.{e}.{theirs}.weight", lambda k=key, e=e: _expert(reader, k, e)
    if shared:
        for ours, theirs in zip(_OURS, _THEIRS["qwen2_moe"], strict=True):
            key = f"{src}mlp.shared_experts.{ours}.weight"
            yield f"{block}shared_expert.{theirs}.weight", lambda k=key: reader.read(k)
        yield (f"{block}shared_expert_gate.weight",
               lambda: reader.read(src + "mlp.shared_experts.gate_weight"))  # fmt: skip


def _expert(reader, key: str, e: int) -> torch.Tensor:
    """Expert e's slice of the stacked tensor `key`, reading only that slice."""
    shape = reader.shape(key)
    return reader.read(key, Region((e,) + (0,) * (len(shape) - 1), (1, *shape[1:])))[0]
