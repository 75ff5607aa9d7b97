"""The family tables without transformers: each names every parameter once, the registry
lists every family file, family_of finds the family a model's settings describe, and
import refuses a tensor its family has no place for."""

from pathlib import Path

import pytest
import torch

from mp_ckpt.families import ARCHITECTURES, family, family_of
from mp_ckpt.families.table import Dims
from mp_ckpt.hf import logical_from_hf, model_config_from_hf

FOLDER = Path(__file__).resolve().parents[1] / "src" / "mp_ckpt" / "families"
LLAMA_STYLE = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 32}  # fmt: skip
CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 4, "vocab_size": 32,
             "n_positions": 8},
    "llama": {"model_type": "llama", **LLAMA_STYLE},
    "mistral": {"model_type": "mistral", **LLAMA_STYLE, "sliding_window": 4},
    "qwen2": {"model_type": "qwen2", **LLAMA_STYLE},
    "qwen3": {"model_type": "qwen3", **LLAMA_STYLE, "head_dim": 8},
    "nemotron": {"model_type": "nemotron", **LLAMA_STYLE},
    "mixtral": {"model_type": "mixtral", **LLAMA_STYLE, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", **LLAMA_STYLE, "num_experts": 4,
                  "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8,
                  "num_experts_per_tok": 2},
    "gpt_oss": {"model_type": "gpt_oss", **LLAMA_STYLE, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 4, "head_dim": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "qwen3_moe": {"model_type": "qwen3_moe", **LLAMA_STYLE, "num_experts": 4,
                  "moe_intermediate_size": 8, "num_experts_per_tok": 2},
}  # fmt: skip


def test_the_registry_lists_every_family_file():
    files = {p.stem for p in FOLDER.glob("*.py") if "\nFAMILY = " in p.read_text()}
    assert files == set(ARCHITECTURES) == set(CONFIGS)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_parameter_is_named_once(name):
    rules = family(name).rules
    for side in ("mp", "hf_names"):
        names = [(r.scope, n) for r in rules for n in getattr(r, side)]
        assert len(names) == len(set(names)), (name, side)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_family_of_finds_the_family_of_its_settings(name):
    assert family_of(model_config_from_hf(CONFIGS[name])) == name


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_config_written_names_the_family(name):
    fam = family(name)
    settings = fam.settings(CONFIGS[name])
    dims = Dims.of(settings)
    shapes = {"vocab": 32, "hidden": dims.hidden, "layers": settings["num_layers"],
              "heads": dims.heads, "groups": dims.groups, "head_dim": dims.head_dim,
              "tied": True, "positions": 8, "ffn": settings.get("ffn_hidden_size"),
              "experts": 4, "expert_ffn": 8, "shared_ffn": 8,
              "sparse": [1] * settings["num_layers"]}  # fmt: skip
    config = fam.config(settings, shapes, {}, "float32")
    assert (config["architectures"], config["model_type"]) == ([fam.architecture], name)


def test_a_mistral_without_a_window_computes_as_llama():
    settings = model_config_from_hf(CONFIGS["mistral"] | {"sliding_window": None})
    assert family_of(settings) == "llama"


def random_state(config: dict) -> dict[str, torch.Tensor]:
    """Random Hugging Face tensors of the right shapes, made by exporting random logical
    tensors through the family's rules."""
    fam = family(config["model_type"])
    settings = fam.settings(config)
    dims, torch_gen = Dims.of(settings), torch.Generator().manual_seed(0)
    h, d, f, v = dims.hidden, dims.head_dim, settings["ffn_hidden_size"], settings["vocab_size"]
    shapes = {
        "embedding.word_embeddings.weight": (v, h), "output_layer.weight": (v, h),
        "decoder.final_layernorm.weight": (h,), "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.q.weight": (dims.groups, dims.per_group, d, h),
        "self_attention.linear_qkv.k.weight": (dims.groups, d, h),
        "self_attention.linear_qkv.v.weight": (dims.groups, d, h),
        "self_attention.linear_qkv.q.bias": (dims.groups, dims.per_group, d),
        "self_attention.linear_qkv.k.bias": (dims.groups, d),
        "self_attention.linear_qkv.v.bias": (dims.groups, d),
        "self_attention.linear_proj.weight": (h, dims.heads * d),
        "mlp.linear_fc1.gate.weight": (f, h), "mlp.linear_fc1.up.weight": (f, h),
        "mlp.linear_fc2.weight": (h, f),
    }  # fmt: skip
    state = {}
    for rule in fam.rules_for("model", settings) + fam.rules_for("layer", settings) + \
            fam.rules_for("dense", settings):  # fmt: skip
        tensors = [torch.randn(shapes[n], generator=torch_gen) for n in rule.mp]
        for i in (None,) if rule.scope == "model" else range(settings["num_layers"]):
            for n, t in zip(rule.hf_names, rule.export(tensors, dims), strict=True):
                state[n.replace("{i}", str(i))] = t
    return state


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_import_refuses_a_tensor_its_family_has_no_place_for(name):
    config = CONFIGS[name]
    state = random_state(config)
    assert "decoder.layers.1.mlp.linear_fc1.up.weight" in logical_from_hf(state, config)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)  # not a weight
    logical_from_hf(state, config)
    state["model.layers.0.mlp.extra_proj.weight"] = torch.ones(2)
    with pytest.raises(ValueError, match=r"no place for: model\.layers\.0\.mlp\.extra_proj"):
        logical_from_hf(state, config)
