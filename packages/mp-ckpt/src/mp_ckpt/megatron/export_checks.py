"""What export-megatron refuses, checked before any tensor is written (write.py):
`check_exportable`, each refusal one line naming the setting or the size at fault."""

from __future__ import annotations

import argparse
import re

from mp_ckpt.families.table import Dims
from mp_ckpt.megatron.settings import MLA_COPIED, held_mtp_modules
from mp_ckpt.megatron.tp_layout import latent_rows

__all__ = ["FORMATS", "check_exportable", "refuse_mp_only_settings"]

FORMATS = ("torch_dist", "torch")
"""The checkpoint formats export-megatron writes."""


def check_exportable(
    settings: dict, keys: list[str], tp: int, pp: int, fmt: str, ep: int = 1
) -> None:
    """Raises a one-line ValueError naming what the export cannot write: a format, the
    model (a latent MoE), multi-token prediction modules that disagree with
    the settings, or sizes the layout does not divide."""
    if fmt not in FORMATS:
        raise ValueError(f"--ckpt-format {fmt!r}: expected torch_dist or torch")
    if settings.get("moe_latent_size") is not None:
        raise ValueError(
            f"moe_latent_size={settings['moe_latent_size']!r}: mp does not write latent MoE "
            "layers (their fc1_latent_proj and fc2_latent_proj) to Megatron-LM checkpoints"
        )
    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"TP={tp}, PP={pp}, EP={ep}: each must be >= 1")
    latent = settings.get("latent_norm_epsilon")
    if latent is not None and latent != settings.get("layernorm_epsilon", 1e-5):
        raise ValueError(
            f"latent_norm_epsilon={latent!r} beside layernorm_epsilon="
            f"{settings.get('layernorm_epsilon', 1e-5)!r}: Megatron-LM normalizes MLA's "
            "latents with its one layernorm_epsilon"
        )
    if settings.get("hybrid_layer_pattern") or any(".mixer." in k for k in keys):
        _check_hybrid(settings, tp)
    modules = {m.group(1) for k in keys if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
    if len(modules) != held_mtp_modules(settings):
        raise ValueError(
            f"the checkpoint holds {len(modules)} multi-token prediction modules, its "
            f"model_config mtp_num_layers={settings.get('mtp_num_layers')!r} and "
            f"mtp_use_repeated_layer={bool(settings.get('mtp_use_repeated_layer'))}"
        )
    experts = settings.get("num_moe_experts")
    if not experts and any(".mlp.experts." in k or ".mlp.router." in k for k in keys):
        raise ValueError("the checkpoint holds experts but its model_config no num_moe_experts")
    if experts:
        if experts % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} does not divide "
                             f"num_moe_experts {experts}")  # fmt: skip
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if settings.get(name) and settings[name] % tp:
                raise ValueError(f"--tensor-model-parallel-size {tp} does not divide {name} "
                                 f"{settings[name]}")  # fmt: skip
    elif ep != 1:
        raise ValueError(f"--expert-model-parallel-size {ep}: the model has no experts")
    heads, groups = settings["num_attention_heads"], settings["num_query_groups"]
    layers, vocab = settings["num_layers"], settings["vocab_size"]
    for what, n in (("num_attention_heads", heads),
                    ("ffn_hidden_size", settings["ffn_hidden_size"]),
                    ("the padded vocabulary", vocab)):  # fmt: skip
        if n % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide {what} {n}")
    # Megatron-LM shares each of fewer query groups than ranks among tp / groups ranks
    if groups % tp and tp % groups:
        raise ValueError(f"--tensor-model-parallel-size {tp} neither divides num_query_groups "
                         f"{groups} nor is a multiple of it")  # fmt: skip
    if layers % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} does not divide num_layers "
                         f"{layers}")  # fmt: skip
    shared = (settings.get("experimental_attention_variant") == "dsa"
              and (settings.get("dsa_indexer_topk_freq") or 1) > 1)  # fmt: skip
    stacked = not isinstance(settings.get("moe_layer_freq", 1), list)
    if fmt == "torch_dist" and shared and stacked:
        raise ValueError(
            f"dsa_indexer_topk_freq={settings['dsa_indexer_topk_freq']} with layers "
            "megatron-core stacks (moe_layer_freq not a list): its stacked indexer tensors "
            "would lack the layers that reuse another's choice, which mp does not write; "
            "write --ckpt-format torch"
        )
    if fmt == "torch" and tp > 1 and settings.get("experimental_attention_variant") == "dsa":
        raise ValueError(
            f"--ckpt-format torch at --tensor-model-parallel-size {tp} with "
            "experimental_attention_variant 'dsa': megatron-core builds DeepSeek's sparse "
            "attention with Transformer Engine's spec alone, whose down projections the legacy "
            "files hold whole on every rank, where mp writes the local spec's; write torch_dist"
        )
    if fmt == "torch" and settings.get("multi_latent_attention"):
        # the local spec's down projections are column-parallel: TP splits their rows
        rows = latent_rows(argparse.Namespace(**{**MLA_COPIED, **settings}))
        for module, n in rows.items():
            if n % tp:
                raise ValueError(f"--tensor-model-parallel-size {tp} does not divide the "
                                 f"{n} rows of {module} (legacy torch: Megatron's local "
                                 "spec splits them)")  # fmt: skip


def _check_hybrid(settings: dict, tp: int) -> None:
    """A hybrid model's Mamba heads and groups divided by TP (megatron-core's MambaMixer
    splits both)."""
    pattern = settings.get("hybrid_layer_pattern")
    if not pattern:
        raise ValueError("the checkpoint holds Mamba mixers but its model_config no "
                         "hybrid_layer_pattern")  # fmt: skip
    if "M" in pattern:
        dims = Dims.of(settings)
        for what, n in (("mamba_num_heads", dims.mamba_heads),
                        ("mamba_num_groups", dims.mamba_groups)):  # fmt: skip
            if n % tp:
                raise ValueError(f"--tensor-model-parallel-size {tp} does not divide {what} {n}")


def refuse_mp_only_settings(settings: dict) -> None:
    """Megatron-LM normalizes each sublayer's input and each query and key head, and
    rotates every layer alike: a model normalized otherwise (OLMo 2's, Gemma's) or whose
    windowed layers rotate with a base of their own (OLMo 3's, Gemma 3's), or with Gemma's
    scales, Granite's multipliers or Ministral 3's query scaling, has no Megatron-LM form.
    Nor has Gemma's gated GELU: Megatron-LM's flags gate silu alone."""
    if settings.get("activation") == "geglu":
        raise ValueError("model_config activation='geglu': Megatron-LM's flags gate silu "
                         "alone (--swiglu)")  # fmt: skip
    megatron_values = (("sublayer_norm", "input"), ("qk_layernorm_scope", "head"),
                       ("window_rotary_base", None), ("scale_word_embeddings", False),
                       ("query_pre_attn_scalar", None), ("word_embedding_multiplier", 1.0),
                       ("residual_multiplier", 1.0), ("logits_scaling", 1.0),
                       ("query_log_scale_beta", None))  # fmt: skip
    for name, megatron in megatron_values:
        value = settings.get(name, megatron)
        if value != megatron:
            raise ValueError(f"model_config {name}={value!r}: Megatron-LM computes only "
                             f"{name}={megatron!r}")  # fmt: skip
