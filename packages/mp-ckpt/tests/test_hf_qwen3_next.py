"""Qwen3-Next <-> mp without transformers: config.json's forms (layer_types or
full_attention_interval, partial_rotary_factor in rope_parameters or at the top), its
refusals, and what the multi-token prediction tensors must be. Logits, greedy tokens, the
module's loss and the export against transformers' model and blocks:
tests/test_hf_families.py -k qwen3_next."""

import pytest
import torch

from mp_ckpt.families.table import Dims
from mp_ckpt.hf import logical_from_hf, model_config_from_hf

CONFIG = {
    "model_type": "qwen3_next", "hidden_size": 16, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 32,
    "intermediate_size": 24, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 8, "mlp_only_layers": [1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
}  # fmt: skip


def test_config_forms_give_the_same_settings():
    """full_attention_interval 4 and its layer_types agree; partial_rotary_factor is read
    from rope_parameters or the top level (transformers' default 0.25 when absent)."""
    settings = model_config_from_hf(CONFIG)
    assert settings["linear_attention_freq"] == [1, 1, 1, 0]
    assert settings["rotary_percent"] == 0.25 and settings["rotary_base"] == 10000000
    assert settings["experimental_attention_variant"] == "gdn"
    assert settings["attention_output_gate"] and settings["apply_layernorm_1p"]
    assert settings["moe_layer_freq"] == [1, 0, 1, 1]
    types = ["linear_attention"] * 3 + ["full_attention"]
    assert model_config_from_hf(CONFIG | {"layer_types": types}) == settings
    top = {k: v for k, v in CONFIG["rope_parameters"].items() if k != "partial_rotary_factor"}
    half = model_config_from_hf(CONFIG | {"rope_parameters": top, "partial_rotary_factor": 0.5})
    assert half["rotary_percent"] == 0.5


@pytest.mark.parametrize(
    ("change", "message"),
    [({"num_experts": 0}, r"num_experts=0"),
     ({"attention_bias": True}, r"attention_bias=True"),
     ({"layer_types": ["linear_attention"] * 3}, r"layer_types=.*expected 4 entries"),
     ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, r"layer_types=")],
)  # fmt: skip
def test_refusals_name_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(CONFIG | change)


def test_multi_token_prediction_modules_come_from_the_weights():
    """config.json names no module: the weights' mtp.* do (one module, its layer softmax
    attention, as the model's last); a module missing a tensor is refused naming it, and
    so are two modules and a last layer that is a DeltaNet."""
    settings = model_config_from_hf(CONFIG)
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator)
             for name, shape in hf_shapes(settings).items()}  # fmt: skip
    assert "mtp_num_layers" not in logical_from_hf(dict(state), CONFIG) and not any(
        k.startswith("mtp.") for k in logical_from_hf(dict(state), CONFIG)
    )
    module = {"mtp.fc.weight": torch.zeros(16, 32), "mtp.norm.weight": torch.zeros(16)}
    with pytest.raises(KeyError, match=r"no tensor 'mtp\.pre_fc_norm_embedding\.weight'"):
        logical_from_hf(state | module, CONFIG)
    two = CONFIG | {"num_nextn_predict_layers": 2}
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=2: Qwen3-Next's layout"):
        model_config_from_hf(two)
    types = ["full_attention"] + ["linear_attention"] * 3
    linear_last = CONFIG | {"num_nextn_predict_layers": 1, "layer_types": types}
    with pytest.raises(ValueError, match=r"shaped as the model's last layer"):
        model_config_from_hf(linear_last)


def hf_shapes(settings) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors (name -> shape) of the CONFIG model, from an export of
    zeros of mp's shapes."""

    dims, h, layers = Dims.of(settings), 16, 4
    shapes = {"model.embed_tokens.weight": (32, h), "model.norm.weight": (h,),
              "lm_head.weight": (32, h)}  # fmt: skip
    r, hk, dk, dv = 2, 2, 4, 4
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if i == 3:
            a = p + "self_attn."
            shapes |= {a + "q_proj.weight": (4 * 2 * 4, h), a + "k_proj.weight": (8, h),
                       a + "v_proj.weight": (8, h), a + "o_proj.weight": (h, 16),
                       a + "q_norm.weight": (4,), a + "k_norm.weight": (4,)}  # fmt: skip
        else:
            a = p + "linear_attn."
            shapes |= {a + "in_proj_qkvz.weight": (hk * (2 * dk + 2 * r * dv), h),
                       a + "in_proj_ba.weight": (hk * 2 * r, h),
                       a + "conv1d.weight": (2 * hk * dk + hk * r * dv, 1, 4),
                       a + "dt_bias": (4,), a + "A_log": (4,), a + "norm.weight": (dv,),
                       a + "out_proj.weight": (h, 16)}  # fmt: skip
        m = p + "mlp."
        if i == 1:
            shapes |= {m + "gate_proj.weight": (24, h), m + "up_proj.weight": (24, h),
                       m + "down_proj.weight": (h, 24)}  # fmt: skip
        else:
            shapes |= {m + "gate.weight": (4, h), m + "shared_expert_gate.weight": (1, h),
                       m + "shared_expert.gate_proj.weight": (8, h),
                       m + "shared_expert.up_proj.weight": (8, h),
                       m + "shared_expert.down_proj.weight": (h, 8)}  # fmt: skip
            for e in range(4):
                shapes |= {f"{m}experts.{e}.{n}.weight": (8, h) for n in ("gate_proj", "up_proj")}
                shapes[f"{m}experts.{e}.down_proj.weight"] = (h, 8)
    assert (dims.linear_key_heads, dims.linear_value_heads) == (hk, hk * r)
    return shapes
