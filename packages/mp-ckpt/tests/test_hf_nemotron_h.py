"""Nemotron-H (Mamba-hybrid) <-> mp without transformers: config.json's older and current
forms read alike, what mp does not compute refused, in_proj and conv1d split by group and
fused back exactly, transformers' in-memory names (model.*, fused experts) imported as the
saved ones, a tied output layer exported as a copy, and the Megatron conversions refusing
hybrid models. tests/test_hf_families.py checks the logits against transformers."""

import argparse

import pytest
import torch

from mp_ckpt import Checkpointer, ShardedTensor
from mp_ckpt.families import family, family_of
from mp_ckpt.families.table import Dims
from mp_ckpt.hf import export_hf, logical_from_hf, model_config_from_hf
from mp_ckpt.megatron.settings import model_config_from_megatron
from mp_ckpt.megatron.write import export_megatron

H, HEADS, P, G, N, VOCAB = 16, 4, 4, 2, 4, 32
INNER = HEADS * P
CONFIG = {
    "model_type": "nemotron_h", "vocab_size": VOCAB, "hidden_size": H, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 24, "mamba_num_heads": HEADS,
    "mamba_head_dim": P, "n_groups": G, "ssm_state_size": N, "chunk_size": 8,
    "layers_block_type": ["linear_attention", "mlp", "full_attention", "moe"],
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    "moe_shared_expert_intermediate_size": 12, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "tie_word_embeddings": False,
}  # fmt: skip


def test_settings_of_the_current_and_the_older_config_json_agree():
    settings = model_config_from_hf(CONFIG)
    assert settings["hybrid_layer_pattern"] == "M-*E" and settings["num_layers"] == 4
    assert (settings["mamba_num_heads"], settings["mamba_head_dim"], settings["mamba_num_groups"],
            settings["mamba_state_dim"]) == (HEADS, P, G, N)  # fmt: skip
    assert settings["position_embedding_type"] == "none"
    assert settings["activation"] == "squared_relu" and settings["kv_channels"] == 4
    assert settings["moe_router_score_function"] == "sigmoid"
    assert settings["moe_router_enable_expert_bias"] is True
    assert settings["moe_router_topk_scaling_factor"] == 2.5
    assert family_of(settings) == "nemotron_h"
    older = {k: v for k, v in CONFIG.items() if k not in ("layers_block_type", "n_groups",
                                                          "chunk_size")}  # fmt: skip
    older |= {
        "hybrid_override_pattern": "M-*E",
        "num_hidden_layers": 4,
        "mamba_n_groups": G,
        "mamba_chunk_size": 8,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
    }
    assert model_config_from_hf(older) == settings
    legacy_names = CONFIG | {"layers_block_type": ["mamba", "mlp", "attention", "moe"]}
    assert model_config_from_hf(legacy_names) == settings


@pytest.mark.parametrize(("change", "message"), [
    ({"use_conv_bias": False}, "use_conv_bias=False"),
    ({"conv_kernel": 3}, "conv_kernel=3"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"use_bias": True}, "use_bias=True"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias=True"),
    ({"num_nextn_predict_layers": 1}, "multi-token prediction"),
    ({"time_step_limit": [0.01, 10.0]}, "does not clamp the time step"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 1, "norm_topk_prob": False},
     "ranks a group by its 2 best"),
    ({"layers_block_type": ["linear_attention", "sliding_attention"]}, "sliding_attention"),
])  # fmt: skip
def test_what_mp_does_not_compute_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(CONFIG | change)


def test_in_proj_and_conv1d_split_by_group_and_fuse_back():
    settings = model_config_from_hf(CONFIG)
    dims, rules = Dims.of(settings), {r.mp[0]: r for r in family("nemotron_h").rules}
    gn = G * N
    in_proj = torch.randn(2 * INNER + 2 * gn + HEADS, H)
    z, x, B, C, dt = rules["mixer.in_proj.z.weight"].import_([in_proj], dims)
    assert z.shape == x.shape == (G, INNER // G, H) and B.shape == C.shape == (G, N, H)
    assert dt.shape == (G, HEADS // G, H)
    assert torch.equal(B[1], in_proj[2 * INNER + N : 2 * INNER + gn])  # group 1's B rows
    assert torch.equal(rules["mixer.in_proj.z.weight"].export([z, x, B, C, dt], dims)[0], in_proj)
    conv = torch.randn(INNER + 2 * gn, 1, 4)
    parts = rules["mixer.conv1d.x.weight"].import_([conv], dims)
    assert [p.shape for p in parts] == [(G, INNER // G, 4), (G, N, 4), (G, N, 4)]
    assert torch.equal(rules["mixer.conv1d.x.weight"].export(parts, dims)[0], conv)
    bias = torch.randn(INNER + 2 * gn)
    parts = rules["mixer.conv1d.x.bias"].import_([bias], dims)
    assert torch.equal(rules["mixer.conv1d.x.bias"].export(parts, dims)[0], bias)


def saved_state(config: dict) -> dict[str, torch.Tensor]:
    """Random tensors under the names transformers saves (backbone.*, experts one by one)."""
    gen = torch.Generator().manual_seed(0)
    gn, f, e, ef, s = G * N, config["intermediate_size"], 4, 8, 12
    shapes = {
        "backbone.embeddings.weight": (VOCAB, H), "backbone.norm_f.weight": (H,),
        "lm_head.weight": (VOCAB, H),
        "mixer.in_proj.weight": (2 * INNER + 2 * gn + HEADS, H),
        "mixer.conv1d.weight": (INNER + 2 * gn, 1, 4), "mixer.conv1d.bias": (INNER + 2 * gn,),
        "mixer.dt_bias": (HEADS,), "mixer.A_log": (HEADS,), "mixer.D": (HEADS,),
        "mixer.norm.weight": (INNER,), "mixer.out_proj.weight": (H, INNER),
        "mixer.up_proj.weight": (f, H), "mixer.down_proj.weight": (H, f),
        "mixer.q_proj.weight": (16, H), "mixer.k_proj.weight": (8, H),
        "mixer.v_proj.weight": (8, H), "mixer.o_proj.weight": (H, 16),
        "mixer.gate.weight": (e, H), "mixer.gate.e_score_correction_bias": (e,),
        "mixer.shared_experts.up_proj.weight": (s, H),
        "mixer.shared_experts.down_proj.weight": (H, s),
        **{f"mixer.experts.{i}.up_proj.weight": (ef, H) for i in range(e)},
        **{f"mixer.experts.{i}.down_proj.weight": (H, ef) for i in range(e)},
    }  # fmt: skip
    kinds = {0: ("mixer.in_proj", "mixer.conv1d", "mixer.dt_bias", "mixer.A_log", "mixer.D",
                 "mixer.norm", "mixer.out_proj"),
             1: ("mixer.up_proj", "mixer.down_proj"), 2: ("mixer.q_proj", "mixer.k_proj",
                                                          "mixer.v_proj", "mixer.o_proj"),
             3: ("mixer.gate", "mixer.shared_experts", "mixer.experts")}  # fmt: skip
    state = {}
    for name, shape in shapes.items():
        if name.startswith(("backbone.", "lm_head")):
            state[name] = torch.randn(shape, generator=gen)
            continue
        for i, prefixes in kinds.items():
            if name.startswith(prefixes):
                state[f"backbone.layers.{i}.{name}"] = torch.randn(shape, generator=gen)
    for i in range(4):
        state[f"backbone.layers.{i}.norm.weight"] = torch.randn(H, generator=gen)
    return state


def test_transformers_in_memory_names_import_as_the_saved_ones():
    saved = saved_state(CONFIG)
    want = logical_from_hf(saved, CONFIG)
    assert want["decoder.layers.3.mlp.experts.linear_fc1.weight"].shape == (4, 8, H)
    in_memory = {}
    for name, tensor in saved.items():
        if ".experts." not in name:
            in_memory[name.replace("backbone.", "model.", 1)] = tensor
    for part in ("up_proj", "down_proj"):
        experts = [saved[f"backbone.layers.3.mixer.experts.{e}.{part}.weight"] for e in range(4)]
        in_memory[f"model.layers.3.mixer.experts.{part}"] = torch.stack(experts)
    got = logical_from_hf(in_memory, CONFIG)
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def checkpoint(tmp_path, logical: dict, settings: dict):
    pieces = {k: ShardedTensor(k, t.contiguous(), tuple(t.shape), (0,) * t.dim())
              for k, t in logical.items()}  # fmt: skip
    common = {"iteration": 0, "model_config": settings}
    Checkpointer(tmp_path / "ckpt").save(0, pieces, common=common)
    return tmp_path / "ckpt"


def test_a_tied_output_layer_exports_as_a_copy_of_the_embedding(tmp_path):
    from safetensors.torch import load_file

    logical = logical_from_hf(saved_state(CONFIG), CONFIG)
    del logical["output_layer.weight"]
    settings = model_config_from_hf(CONFIG) | {"untie_embeddings_and_output_weights": False}
    out = export_hf(checkpoint(tmp_path, logical, settings), tmp_path / "hf")
    exported = load_file(str(out / "model.safetensors"))
    assert torch.equal(exported["lm_head.weight"], logical["embedding.word_embeddings.weight"])
    # read back: transformers' model keeps lm_head whatever tie_word_embeddings says
    assert model_config_from_hf(CONFIG)["untie_embeddings_and_output_weights"] is True
    back = logical_from_hf(exported, CONFIG)
    assert torch.equal(back["output_layer.weight"], logical["embedding.word_embeddings.weight"])


def test_the_megatron_conversions_refuse_hybrid_models(tmp_path):
    settings = model_config_from_hf(CONFIG)
    logical = logical_from_hf(saved_state(CONFIG), CONFIG)
    with pytest.raises(ValueError, match="Mamba-hybrid"):
        export_megatron(checkpoint(tmp_path, logical, settings), tmp_path / "megatron")
    args = argparse.Namespace(num_attention_heads=4, hidden_size=H, num_layers=4,
                              is_hybrid_model=True, hybrid_override_pattern="M-*E")  # fmt: skip
    with pytest.raises(ValueError, match="is_hybrid_model=True: mp does not import"):
        model_config_from_megatron(args, VOCAB)
