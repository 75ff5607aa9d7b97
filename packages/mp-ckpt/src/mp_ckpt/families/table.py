"""A model family as data: every parameter named once, with its transform each way.

A `Rule` ties mp's logical tensors (mp-layers' names) to the Hugging Face tensors
they are stored as:

    Rule(mp=("self_attention.linear_qkv.q.weight",),
         hf="model.layers.{i}.self_attn.q_proj.weight",
         to_hf=heads_flat, to_mp=q_heads, scope="layer")

Names hold "{i}" for the layer (mp's are relative to "decoder.layers.{i}." when the
scope is a layer's) and "{e}" for an expert: a per-expert Hugging Face name stands
for E tensors that mp keeps stacked on dim 0. `to_mp` takes the Hugging Face tensors
(a list, in `hf` order) and returns mp's (in `mp` order); `to_hf` the other way;
both also get the model's `Dims`. Absent, the tensor passes unchanged.

`scope` says where a rule applies: "model" once, "layer" every layer, "dense" a
layer with a plain MLP, "moe" a mixture-of-experts layer, "linear_attention" and
"full_attention" the layers of a model with gated DeltaNet layers (Qwen3-Next) whose
attention is one or softmax attention (`is_linear_attention_layer`), "indexer" the layers
of a model with DeepSeek's sparse attention that choose their own positions (all of them
but those that reuse another layer's choice: `has_dsa_indexer`), "mtp" each multi-token
prediction module (mp's names relative to "mtp.layers.{k}.", "{i}" the Hugging Face
layer number num_layers + k; the module's transformer layer takes the "layer" rules and
those of the last layer's MLP under "mtp.layers.{k}.transformer_layer."). A hybrid model
(settings with a hybrid_layer_pattern) has one sublayer per layer: its layers take the rules
of their kind alone, "mamba" (M), "attention" (*), "dense" (-) or "moe" (E), each with its
own norm (`layer_scopes`). Its multi-token prediction modules are parts of the pattern,
"<main>/<mtp>/<mtp>..." (Megatron-LM's unified pattern; `split_hybrid_pattern`): sublayer j
of module k takes the rules of its kind under "mtp.layers.{k}.mtp_model_layer.layers.{j}.",
their Hugging Face names moved by the family's `mtp_sublayer`, "{i}" numbering the
sublayers of all modules in a row (k L + j, modules of L sublayers); the module's own rules
take the number of its first sublayer ("mtp") or of its last ("mtp_last"). `when(settings)`
says whether the model has the tensor at all (a bias, an untied output layer, ...).
`keep_dtype` exempts a tensor from the export's cast to another dtype. `model_copy`
marks a Hugging Face tensor that repeats the model-level mp tensor named (DeepSeek-V3's
MTP layers hold the embedding and the output layer again): import checks that it
equals it, export writes it again.

`megatron` is Megatron-LM's module holding the tensors (relative like `mp`) where it
differs from mp's; the last part of each mp name (weight, bias) completes its Megatron
name. mp names that land in one Megatron tensor are stored fused there: q, k and v
interleaved per query group in linear_qkv, a gated fc1's gate and up as [gate; up]
(megatron_view.py says how; mp_ckpt.megatron reads and writes through it).

`Family` holds a family's rules with its config.json mapping: `settings(config)`
reads config.json into mp's model settings (Megatron's names) and `config(settings,
dims, tokens, dtype)` writes it back; `held(config, names)` first makes config.json
say what the weights hold. Import and export (mp_ckpt.hf) are loops over these rules.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "Dims",
    "Family",
    "Rule",
    "flat",
    "has_dsa_indexer",
    "has_gated_delta_net_layers",
    "heads_flat",
    "is_linear_attention_layer",
    "is_moe_layer",
    "kv_heads",
    "layer_scopes",
    "mtp_layer_scopes",
    "q_heads",
    "shared_mtp_depth",
    "split_hybrid_pattern",
    "transposed",
]

Tensors = Sequence[torch.Tensor]
Transform = Callable[[Tensors, "Dims"], list[torch.Tensor]]
Scope = Literal[
    "model",
    "layer",
    "dense",
    "moe",
    "mtp",
    "mtp_last",
    "mamba",
    "attention",
    "linear_attention",
    "full_attention",
    "indexer",
]

HYBRID_SCOPES: dict[str, Scope] = {"M": "mamba", "G": "linear_attention", "*": "attention",
                                   "-": "dense", "E": "moe"}  # fmt: skip
"""The scope of a hybrid layer's rules, by its symbol in hybrid_layer_pattern."""


@dataclass(frozen=True)
class Dims:
    """The shapes a transform needs: query heads, key/value groups, head dim, hidden; in a
    hybrid model also the Mamba mixers' heads, channels per head, groups and state size
    (0 without Mamba layers); with gated DeltaNet layers their key heads, key channels,
    value heads and value channels (0 without)."""

    heads: int
    groups: int
    head_dim: int
    hidden: int
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    linear_key_heads: int = 0
    linear_key_dim: int = 0
    linear_value_heads: int = 0
    linear_value_dim: int = 0

    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    @classmethod
    def of(cls, settings: dict) -> Dims:
        heads = settings["num_attention_heads"]
        return cls(
            heads=heads,
            groups=settings.get("num_query_groups") or heads,
            head_dim=settings.get("kv_channels") or settings["hidden_size"] // heads,
            hidden=settings["hidden_size"],
            **_mamba_dims(settings),
            **_linear_dims(settings),
        )


def split_hybrid_pattern(pattern: str | None) -> tuple[str, str | None, int]:
    """(the decoder's layers, one multi-token prediction module's or None, the number of
    modules) of a hybrid_layer_pattern "<main>/<mtp>/<mtp>..." (Megatron-LM's unified
    pattern: every module alike; parts after "/" all empty give no modules; the "|" of
    the decoder's pipeline segments left out)."""
    main, *modules = (pattern or "").split("/")
    main = main.replace("|", "")  # a run's pipeline segments: no part of the model
    if not any(modules):
        return main, None, 0
    for k, part in enumerate(modules[1:], start=1):
        if part != modules[0]:
            raise ValueError(
                f"hybrid_layer_pattern={pattern!r}: every multi-token prediction module's "
                f"layers must be alike; module 0's are {modules[0]!r}, module {k}'s {part!r}"
            )
    return main, modules[0], len(modules)


def _mamba_dims(settings: dict) -> dict:
    """The Mamba widths under TransformerConfig's defaults (mamba_num_heads None: an inner
    width of 2 x hidden_size in heads of mamba_head_dim), where a decoder layer or a
    multi-token prediction module's layer is a Mamba mixer."""
    if "M" not in (settings.get("hybrid_layer_pattern") or ""):
        return {}
    head_dim = settings.get("mamba_head_dim") or 64
    heads = settings.get("mamba_num_heads") or 2 * settings["hidden_size"] // head_dim
    return {"mamba_heads": heads, "mamba_head_dim": head_dim,
            "mamba_groups": settings.get("mamba_num_groups") or 8,
            "mamba_state": settings.get("mamba_state_dim") or 128}  # fmt: skip


def _linear_dims(settings: dict) -> dict:
    """The gated DeltaNet widths (TransformerConfig's defaults for those not given), where
    the model has DeltaNets (Qwen3-Next's layers, a hybrid pattern's G layers)."""
    pattern = settings.get("hybrid_layer_pattern") or ""
    if not has_gated_delta_net_layers(settings) and "G" not in pattern:
        return {}
    return {"linear_key_heads": settings.get("linear_num_key_heads") or 16,
            "linear_key_dim": settings.get("linear_key_head_dim") or 128,
            "linear_value_heads": settings.get("linear_num_value_heads") or 32,
            "linear_value_dim": settings.get("linear_value_head_dim") or 128}  # fmt: skip


GATED_DELTA_NET = ("gdn", "gated_delta_net")
"""experimental_attention_variant's names of gated DeltaNet layers (mp's, megatron-core's);
its "dsa", DeepSeek's sparse attention, is softmax attention in every layer."""


def has_gated_delta_net_layers(settings: dict) -> bool:
    """Whether the settings' linear_attention_freq layers are gated DeltaNets."""
    return settings.get("experimental_attention_variant") in GATED_DELTA_NET


def is_linear_attention_layer(settings: dict, i: int) -> bool:
    """Whether layer i's attention is a gated DeltaNet, read as TransformerConfig reads
    linear_attention_freq: an integer N makes layer i softmax attention where (i + 1) % N
    is 0; else a 0/1 entry per layer."""
    if not has_gated_delta_net_layers(settings):
        return False
    freq = settings.get("linear_attention_freq")
    if isinstance(freq, int):
        return (i + 1) % freq != 0
    return bool(freq[i])


def has_dsa_indexer(settings: dict, i: int) -> bool:
    """Whether layer i (0-based) of a model with DeepSeek's sparse attention chooses its own
    positions, holding an indexer, read as TransformerConfig reads dsa_indexer_topk_freq
    (Megatron-LM's rule): with f > 1 and o = max(dsa_indexer_skip_topk_offset, 1), the
    1-based layer L does when L <= o or (L - o) is a multiple of f; the others reuse the
    choice of the last layer before them that does."""
    if settings.get("experimental_attention_variant") != "dsa":
        return False
    freq = settings.get("dsa_indexer_topk_freq") or 1
    offset = max(settings.get("dsa_indexer_skip_topk_offset") or 0, 1)
    number = i + 1
    return freq == 1 or number <= offset or (number - offset) % freq == 0


def shared_mtp_depth(settings: dict) -> int | None:
    """The first 1-based multi-token prediction depth that would reuse another depth's
    choice under dsa_indexer_topk_freq (Megatron numbers the modules' layers 1, 2, ...
    apart from the decoder's; mp-layers refuses such a depth), None if none does."""
    depths = settings.get("mtp_num_layers") or 0
    return next((k + 1 for k in range(depths) if not has_dsa_indexer(settings, k)), None)


def mtp_layer_scopes(settings: dict) -> tuple[Scope, ...]:
    """The scopes of a multi-token prediction module's transformer layer: the last decoder
    layer's, with an indexer of its own under DeepSeek's sparse attention (its first
    depth chooses for itself, whatever the last decoder layer does)."""
    scopes = layer_scopes(settings, settings["num_layers"] - 1)
    if settings.get("experimental_attention_variant") == "dsa" and "indexer" not in scopes:
        scopes = (scopes[0], "indexer", *scopes[1:])
    return scopes


def is_moe_layer(settings: dict, i: int) -> bool:
    """Whether layer i is a mixture of experts, read as TransformerConfig reads it: an E in
    a hybrid_layer_pattern; else under moe_layer_freq, N or [N] (with more than one layer)
    for every N-th layer from layer 0, or a 0/1 entry per layer."""
    if settings.get("num_moe_experts") is None:
        return False
    pattern = settings.get("hybrid_layer_pattern")
    if pattern:
        return split_hybrid_pattern(pattern)[0][i] == "E"
    freq = settings.get("moe_layer_freq", [1])
    freq = [freq] if isinstance(freq, int) else list(freq)
    if len(freq) == 1 and settings["num_layers"] > 1:
        return i % freq[0] == 0
    return bool(freq[i])


def layer_scopes(settings: dict, i: int) -> tuple[Scope, ...]:
    """The scopes of the rules of decoder layer i: its kind's in a hybrid model, else every
    layer's, with gated DeltaNet layers those of its attention ("linear_attention" or
    "full_attention"), with DeepSeek's sparse attention its indexer's where it has one
    ("indexer"), and those of its MLP (experts or not)."""
    pattern = settings.get("hybrid_layer_pattern")
    if pattern:
        return (HYBRID_SCOPES[split_hybrid_pattern(pattern)[0][i]],)
    mlp: Scope = "moe" if is_moe_layer(settings, i) else "dense"
    if has_gated_delta_net_layers(settings):
        attention: Scope = (
            "linear_attention" if is_linear_attention_layer(settings, i) else "full_attention"
        )
        return ("layer", attention, mlp)
    if has_dsa_indexer(settings, i):
        return ("layer", "indexer", mlp)
    return ("layer", mlp)


@dataclass(frozen=True)
class Rule:
    mp: tuple[str, ...]
    hf: str | tuple[str, ...]
    scope: Scope = "layer"
    to_mp: Transform | None = None
    to_hf: Transform | None = None
    when: Callable[[dict], bool] | None = None
    megatron: str | None = None
    keep_dtype: bool = False
    """Written in the checkpoint's dtype whatever export-hf's --dtype says (transformers
    keeps DeepSeek-V3's e_score_correction_bias in fp32)."""
    model_copy: bool = False
    """The Hugging Face tensor repeats the model-level mp tensor `mp` names."""

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else self.hf

    @property
    def per_expert(self) -> bool:
        return any("{e}" in name for name in self.hf_names)

    def applies(self, settings: dict) -> bool:
        return self.when is None or bool(self.when(settings))

    def import_(self, tensors: Tensors, dims: Dims) -> list[torch.Tensor]:
        out = list(tensors) if self.to_mp is None else self.to_mp(tensors, dims)
        return _checked(out, len(self.mp), "to_mp", self)

    def export(self, tensors: Tensors, dims: Dims) -> list[torch.Tensor]:
        out = list(tensors) if self.to_hf is None else self.to_hf(tensors, dims)
        return _checked(out, len(self.hf_names), "to_hf", self)


def _checked(out: list, count: int, what: str, rule: Rule) -> list:
    if len(out) != count:
        raise ValueError(f"{rule.mp}: {what} gave {len(out)} tensors, expected {count}")
    return out


@dataclass(frozen=True)
class Family:
    """One model family: its Hugging Face names and its parameter table."""

    model_type: str
    architecture: str
    """transformers' class (config.json's "architectures"), written by `config`."""
    rules: tuple[Rule, ...]
    settings: Callable[[dict], dict]
    config: Callable[[dict, dict, dict, str], dict]
    prepare: Callable[[dict, dict], dict] | None = None
    """Rewrites a Hugging Face state dict into the names of `rules` before import
    (transformers' in-memory fused experts -> its saved per-expert names)."""
    held: Callable[[dict, Collection[str]], dict] | None = None
    """config.json as the weights (their names) show it, before its settings are read
    (DeepSeek-V3: num_nextn_predict_layers 0 for weights without multi-token prediction
    layers, which transformers neither builds nor saves but counts in config.json)."""
    mtp_sublayer: tuple[str, str] | None = None
    """A hybrid model's multi-token prediction sublayers: (the Hugging Face prefix of the
    decoder layers' rules, the one a sublayer's tensors have instead), "{i}" numbering the
    sublayers of all modules in a row (Nemotron-H: "backbone.layers.{i}." ->
    "mtp.layers.{i}."). None: the family converts no such layers."""
    hf_layer: Callable[[dict, int], int] | None = None
    """The Hugging Face layer number of mp's decoder layer i (settings, i), where the two
    differ: Granite 4's Hugging Face layer j is two of mp's hybrid layers, 2j its mixer and
    2j + 1 its MLP. None: the same number."""

    def rules_for(self, scope: Scope, settings: dict) -> list[Rule]:
        return [r for r in self.rules if r.scope == scope and r.applies(settings)]


# --- transforms ---------------------------------------------------------------------------


def q_heads(t: Tensors, dims: Dims) -> list[torch.Tensor]:
    """[heads x d, ...] -> mp's [groups, heads per group, d, ...] (Hugging Face orders the
    query heads by group already: head j reads key/value head j // heads per group)."""
    return [t[0].reshape(dims.groups, dims.per_group, dims.head_dim, *t[0].shape[1:])]


def kv_heads(t: Tensors, dims: Dims) -> list[torch.Tensor]:
    """[groups x d, ...] -> mp's [groups, d, ...]."""
    return [t[0].reshape(dims.groups, dims.head_dim, *t[0].shape[1:])]


def heads_flat(t: Tensors, dims: Dims) -> list[torch.Tensor]:
    """mp's per-head q / k / v weight ([groups, (per group,) d, h]) -> [heads x d, h]."""
    return [t[0].reshape(-1, dims.hidden)]


def flat(t: Tensors, dims: Dims) -> list[torch.Tensor]:
    """mp's per-head q / k / v bias ([groups, (per group,) d]) -> [heads x d]."""
    return [t[0].reshape(-1)]


def transposed(t: Tensors, dims: Dims) -> list[torch.Tensor]:
    return [t[0].t().contiguous()]
