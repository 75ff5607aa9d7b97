"""Every family mp builds goes to a Megatron-LM checkpoint and back: a random transformers
model imported by import-hf, written by export-megatron (torch_dist at TP2, legacy torch
at TP1 x PP2), read back by import-megatron: every tensor and every model setting the
family depends on comes back (mp's writer and reader; Megatron-LM's own loading of these
formats is checked on the fixtures of packages/mp-ckpt/tests, none of which has gpt-oss's
sinks, windows, YaRN or biased experts)."""

import dataclasses
import os

import pytest
import torch

from mp_ckpt import CheckpointReader, import_megatron
from mp_ckpt.cli import main
from mp_ckpt.families.moe import is_moe_layer
from mp_ckpt.megatron.write import export_megatron
from mp_layers import TransformerConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64, intermediate_size=96)  # fmt: skip
CASES = {
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=16, num_experts=4,
                                                     num_experts_per_tok=2,
                                                     moe_intermediate_size=32,
                                                     norm_topk_prob=True),
    "nemotron": lambda: transformers.NemotronConfig(**SMALL, head_dim=8),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=8),
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL | {"intermediate_size": 32},
                                                 head_dim=8, num_local_experts=4,
                                                 num_experts_per_tok=2, sliding_window=8),
}  # fmt: skip
LAYOUTS = {"torch_dist-tp2": ("torch_dist", 2, 1), "torch-pp2": ("torch", 1, 2)}
FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
          "kv_channels", "normalization", "apply_layernorm_1p", "activation", "qk_layernorm",
          "add_qkv_bias", "rotary_percent", "rotary_base", "window_size",
          "untie_embeddings_and_output_weights", "num_moe_experts", "moe_router_topk",
          "moe_router_pre_softmax", "moe_layer_freq", "softmax_type", "window_attn_skip_freq",
          "position_embedding_type", "yarn_rotary_scaling_factor",
          "yarn_original_max_position_embeddings", "yarn_correction_range_round_to_int",
          "quick_geglu", "glu_linear_offset", "activation_func_clamp_value",
          "add_bias_linear")  # fmt: skip


DEFAULTS = {f.name: f.default for f in dataclasses.fields(TransformerConfig)
            if f.default is not dataclasses.MISSING}  # fmt: skip


def setting(settings: dict, field: str):
    """A setting as TransformerConfig takes it (absent: its default; sequences as tuples;
    the MoE layers as one 0/1 per layer, however written)."""
    if field == "moe_layer_freq":
        return [is_moe_layer(settings, i) for i in range(settings["num_layers"])]
    value = settings.get(field, DEFAULTS.get(field))
    return tuple(value) if isinstance(value, list | tuple) else value


def imported(folder, config):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / "hf")
    assert main(["import-hf", str(folder / "hf"), str(folder / "ckpt")]) == 0
    return folder / "ckpt"


def tensors_and_settings(root):
    reader = CheckpointReader(root)
    common = torch.load(reader.directory / "common.pt", weights_only=False)
    return {k: reader.read(k) for k in reader.keys}, common["model_config"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_family_goes_to_megatron_and_back(tmp_path, case, layout):
    source = imported(tmp_path, CASES[case]())
    fmt, tp, pp = LAYOUTS[layout]
    export_megatron(source, tmp_path / "meg", ckpt_format=fmt, tensor_model_parallel_size=tp,
                    pipeline_model_parallel_size=pp)  # fmt: skip
    import_megatron(tmp_path / "meg", tmp_path / "back")
    want, want_settings = tensors_and_settings(source)
    got, got_settings = tensors_and_settings(tmp_path / "back")
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    for field in FIELDS:
        assert setting(got_settings, field) == setting(want_settings, field), field
