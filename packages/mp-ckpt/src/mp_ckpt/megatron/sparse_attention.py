"""Megatron-LM's args of DeepSeek's sparse attention (experimental_attention_variant "dsa",
the --dsa-* flags: DeepSeek-V3.2's lightning indexer in each multi-latent attention
layer), both ways: `sparse_attention_settings(args)` reads them into mp's settings,
`sparse_attention_args(settings)` writes them back. mp's fields have megatron-core's names,
meanings and defaults (DsaConfig in mp-layers), so each is copied; dsa_kernel_backend
picks Megatron's kernels, not the model, and is neither read nor written.
"""

from __future__ import annotations

__all__ = ["DSA_COPIED", "sparse_attention_args", "sparse_attention_settings"]

DSA_COPIED = {
    "dsa_indexer_n_heads": None, "dsa_indexer_head_dim": None, "dsa_indexer_topk": None,
    "dsa_indexer_topk_freq": 1, "dsa_indexer_skip_topk_offset": 0,
    "dsa_indexer_loss_coeff": None, "dsa_indexer_use_sparse_loss": False,
    "dsa_indexer_rope_interleaved": False, "dsa_indexer_rotate_activation": True,
    "dsa_indexer_scoring_relu": True, "dsa_indexer_k_norm_epsilon": None,
    "dsa_indexer_k_norm_fp32": False,
}  # fmt: skip
"""The indexer's fields under megatron-core's defaults."""
_NEEDED = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")


def _copied(source, get) -> dict:
    """DSA_COPIED's fields of `source` (a field saved as None: its default, but for those
    whose default is None)."""
    values = {}
    for name, default in DSA_COPIED.items():
        value = get(source, name)
        values[name] = default if value is None else value
    return values


def sparse_attention_settings(args, where: str = "args") -> dict:
    """The settings of a model with DeepSeek's sparse attention ({} without)."""
    if getattr(args, "experimental_attention_variant", None) != "dsa":
        return {}
    if not getattr(args, "multi_latent_attention", False):
        raise ValueError(f"{where}: experimental_attention_variant='dsa' without "
                         "multi_latent_attention: megatron-core's sparse attention is "
                         "multi-latent attention's")  # fmt: skip
    missing = [name for name in _NEEDED if getattr(args, name, None) is None]
    if missing:
        raise ValueError(f"{where}: experimental_attention_variant='dsa' without "
                         f"{', '.join(missing)}")  # fmt: skip
    values = _copied(args, lambda a, name: getattr(a, name, None))
    return {"experimental_attention_variant": "dsa"} | values


def sparse_attention_args(settings: dict) -> dict:
    """Megatron's args of the settings' sparse attention ({} without)."""
    if settings.get("experimental_attention_variant") != "dsa":
        return {}
    values = _copied(settings, lambda s, name: s.get(name))
    return {"experimental_attention_variant": "dsa"} | values
