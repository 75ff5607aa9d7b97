"""ERNIE 4.5 dense (model_type "ernie4_5", Ernie4_5ForCausalLM; ERNIE-4.5-0.3B): Llama's
layers and names (llama_style.py) with rotary embeddings on channel pairs (2i, 2i + 1)
(rotary_interleaved, as Llama 4's: the q/k rows import as they are), its own head dim,
and an output layer tied to the embedding by default.

Refused besides Llama's: use_bias (biases on every linear layer; the released models
have none).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings, refuse
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

RULES = (*model_rules(), *attention_rules(), *norm_rules(), *dense_mlp_rules())


def _settings(config: dict) -> dict:
    refuse(config, "use_bias", False)
    plain = {"head_dim": 128, "tie_word_embeddings": True} | config
    base = llama_settings(plain, rope_theta=10000.0, rms_norm_eps=1e-5, max_positions=131072)
    return base | {"rotary_interleaved": True}


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    config = base_config(settings, shapes, tokens, dtype, "ernie4_5", rotary_interleaved=True)
    del config["attention_dropout"]  # Ernie4_5Config has none (a training setting)
    return config | {"architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5",
                     "use_bias": False}  # fmt: skip


FAMILY = Family("ernie4_5", "Ernie4_5ForCausalLM", RULES, _settings, _config)
