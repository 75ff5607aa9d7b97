"""Phi-3 and Phi-4 (model_type "phi3", Phi3ForCausalLM: Phi-3-mini and -medium at 4k,
Phi-4): Llama's layers with the q, k and v projections fused in one qkv_proj and the
MLP's gate and up projections in one gate_up_proj; rotary embeddings on the first
partial_rotary_factor of each head's channels, in halves (rotary_percent); a sliding
window where sliding_window says (Phi-3-mini's 2047; mistral.py's rule, window.py).

Hugging Face (model.layers.{i}.)         mp (decoder.layers.{i}.)
    self_attn.qkv_proj.weight            self_attention.linear_qkv.{q,k,v}.weight: its rows
        [heads x d | groups x d | groups x d] are the query heads (grouped by key/value
        head, as Llama's), then the key heads, then the value heads
    mlp.gate_up_proj.weight [2F, h]      mlp.linear_fc1.gate.weight (the first F rows),
                                         mlp.linear_fc1.up.weight (the last F)
and Llama's other tensors (llama_style.py).

Settings beside Llama's: resid_pdrop is hidden_dropout (and embd_pdrop must equal it:
Megatron's hidden_dropout also drops the embeddings' output); the head dim is hidden /
heads. Refused: rope_type "longrope" (the 128k models, Phi-3.5, Phi-4-mini: per-channel
short and long factors mp's rotary embeddings do not have). original_max_position_embeddings
(longrope's) is not kept: the export writes max_position_embeddings there.
"""

from __future__ import annotations

import torch

from mp_ckpt.families.hf_settings import base_config, llama_settings
from mp_ckpt.families.llama_style import fused_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.table import Dims, Family, Rule, kv_heads, q_heads
from mp_ckpt.families.window import sliding_window, window_size

__all__ = ["FAMILY"]

_LAYER = "model.layers.{i}."
_QKV = "self_attention.linear_qkv"


def _split_qkv(t, dims: Dims) -> list[torch.Tensor]:
    d = dims.head_dim
    q, k, v = t[0].split([dims.heads * d, dims.groups * d, dims.groups * d])
    return [*q_heads([q], dims), *kv_heads([k], dims), *kv_heads([v], dims)]


def _join_qkv(t, dims: Dims) -> list[torch.Tensor]:
    return [torch.cat([x.reshape(-1, dims.hidden) for x in t])]


RULES = (
    *model_rules(),
    Rule((f"{_QKV}.q.weight", f"{_QKV}.k.weight", f"{_QKV}.v.weight"),
         _LAYER + "self_attn.qkv_proj.weight", to_mp=_split_qkv, to_hf=_join_qkv,
         megatron=_QKV),
    Rule(("self_attention.linear_proj.weight",), _LAYER + "self_attn.o_proj.weight"),
    *norm_rules(),
    *fused_mlp_rules(),
)  # fmt: skip


def _settings(config: dict) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    partial = rope.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"config.json rope_type={kind!r}: Phi-3's longrope scales each rotary channel by "
            "short and long factors, which mp's rotary embeddings do not have; mp converts "
            "Phi-3 and Phi-4 models with rope_type 'default'"
        )
    dropout = config.get("resid_pdrop", 0.0)
    if config.get("embd_pdrop", 0.0) != dropout:
        raise ValueError(
            f"config.json embd_pdrop={config['embd_pdrop']!r} with resid_pdrop={dropout!r}: "
            "mp drops the embeddings' output and each sublayer's with one hidden_dropout"
        )
    plain = {k: v for k, v in config.items() if k != "head_dim"} | {"rope_parameters": rope}
    base = llama_settings(plain, rope_theta=10000.0, rms_norm_eps=1e-5, max_positions=4096)
    return base | window_size(config.get("sliding_window")) | {
        "rotary_percent": float(partial), "hidden_dropout": dropout,
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    if shapes["head_dim"] * shapes["heads"] != shapes["hidden"]:
        raise ValueError(
            f"model_config kv_channels={shapes['head_dim']}: Phi-3's heads are hidden_size / "
            f"num_attention_heads = {shapes['hidden'] // shapes['heads']} wide"
        )
    partial = settings.get("rotary_percent", 1.0)
    window = settings.get("window_size")
    config = base_config(settings, shapes, tokens, dtype, "phi3", rotary_percent=partial,
                         window_size=tuple(window) if window else None)  # fmt: skip
    del config["head_dim"]  # Phi3Config has none
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": partial}
    if partial != 1.0:  # Phi-4-mini's config.json holds it at the top too
        config["partial_rotary_factor"] = partial
    dropout = settings.get("hidden_dropout", 0.0)
    return config | {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "sliding_window": sliding_window(settings, shapes["layers"]),
        "original_max_position_embeddings": config["max_position_embeddings"],
        "resid_pdrop": dropout, "embd_pdrop": dropout,
    }  # fmt: skip


FAMILY = Family("phi3", "Phi3ForCausalLM", RULES, _settings, _config)
