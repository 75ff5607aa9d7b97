"""DeepSeek-V2 and V3 <-> mp, without transformers: config.json's keys (in DeepSeek's own
form: rope_scaling beside rope_theta, aux_loss_alpha, seq_aux) read into settings and
written back to the same settings, Kimi K2's model_type read as DeepSeek-V3's, what mp
would compute differently refused by name, on import and on export, and a checkpoint
naming no family exported and imported back (tests/test_hf_families.py compares the
logits and tokens with transformers')."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mp_ckpt import Checkpointer, CheckpointReader, ShardedTensor
from mp_ckpt.families import family
from mp_ckpt.hf import export_hf, import_hf, logical_from_hf, model_config_from_hf

V3 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 8, "kv_lora_rank": 6,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3, "n_routed_experts": 8,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 5,
    "n_shared_experts": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "max_position_embeddings": 160, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4},
    "aux_loss_alpha": 0.001, "seq_aux": True, "moe_layer_freq": 1, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}  # fmt: skip
V2_LITE = V3 | {
    "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
    "q_lora_rank": None, "num_experts_per_tok": 2, "scoring_func": "softmax",
    "topk_method": "group_limited_greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
}  # fmt: skip
SHAPES = {"vocab": 32, "hidden": 16, "layers": 3, "heads": 4, "groups": 4, "head_dim": 4,
          "tied": False, "ffn": 24, "experts": 8, "expert_ffn": 5, "shared_ffn": 10,
          "sparse": [0, 1, 1]}  # fmt: skip


def test_settings_of_deepseek_v3_and_back():
    settings = model_config_from_hf(V3)
    assert settings["multi_latent_attention"] and settings["qk_layernorm"]
    assert (settings["q_lora_rank"], settings["kv_lora_rank"], settings["qk_head_dim"],
            settings["qk_pos_emb_head_dim"], settings["v_head_dim"]) == (8, 6, 4, 2, 3)  # fmt: skip
    assert settings["position_embedding_type"] == "rope" and settings["rope_type"] == "yarn"
    assert (settings["yarn_rotary_scaling_factor"], settings["yarn_mscale_all_dim"],
            settings["yarn_original_max_position_embeddings"]) == (40.0, 1.0, 4)  # fmt: skip
    assert settings["moe_layer_freq"] == [0, 1, 1] and settings["ffn_hidden_size"] == 24
    assert settings["moe_shared_expert_intermediate_size"] == 10
    assert settings["moe_router_score_function"] == "sigmoid"
    assert settings["moe_router_enable_expert_bias"] and settings["moe_router_dtype"] == "fp32"
    assert (settings["moe_router_num_groups"], settings["moe_router_group_topk"]) == (4, 2)
    assert settings["moe_router_topk_scaling_factor"] == 2.5
    assert settings["moe_router_load_balancing_type"] == "seq_aux_loss"
    assert settings["moe_aux_loss_coeff"] == 0.001
    fam = family("deepseek_v3")
    config = fam.config(settings, SHAPES, {}, "bfloat16")
    assert (config["n_shared_experts"], config["first_k_dense_replace"]) == (2, 1)
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_interleave"]
    assert fam.settings(config) == settings
    kimi = model_config_from_hf(V3 | {"model_type": "kimi_k2", "n_group": 1, "topk_group": 1})
    assert kimi == settings | {"moe_router_num_groups": None, "moe_router_group_topk": None}


def test_settings_of_deepseek_v2_lite_and_back():
    settings = model_config_from_hf(V2_LITE)
    assert settings["q_lora_rank"] is None and settings["moe_router_pre_softmax"]
    assert settings["moe_router_score_function"] == "softmax"
    assert not settings["moe_router_enable_expert_bias"]
    # ranked by their best probability: the top 2 // 2 = 1
    assert (settings["moe_router_num_groups"], settings["moe_router_group_topk"]) == (4, 2)
    fam = family("deepseek_v2")
    config = fam.config(settings, SHAPES, {}, "bfloat16")
    assert config["topk_method"] == "group_limited_greedy" and not config["norm_topk_prob"]
    assert fam.settings(config) == settings
    greedy = model_config_from_hf(V2_LITE | {"topk_method": "greedy"})
    assert fam.config(greedy, SHAPES, {}, "bfloat16")["topk_method"] == "greedy"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (V3 | {"scoring_func": "softmax"}, r"scoring_func='softmax': mp computes only"),
        (V3 | {"rope_interleave": False}, r"rope_interleave=False"),
        (V3 | {"norm_topk_prob": False}, r"norm_topk_prob=False with num_experts_per_tok=4"),
        (V3 | {"topk_group": 1}, r"ranks a group by its 2 best scores, .* = 4 best"),
        (V2_LITE | {"num_experts_per_tok": 4}, r"DeepSeek-V2 ranks a group by its best"),
        (V2_LITE | {"norm_topk_prob": True}, r"norm_topk_prob=True: transformers' DeepseekV2"),
        (V2_LITE | {"topk_method": "noaux_tc"}, r"topk_method='noaux_tc'"),
        (V3 | {"num_key_value_heads": 2}, r"num_key_value_heads=2: multi-latent attention"),
        (V3 | {"first_k_dense_replace": 3}, r"first_k_dense_replace=3: expected 0 to"),
        (V3 | {"moe_layer_freq": 2}, r"moe_layer_freq=2: mp computes only moe_layer_freq=1"),
        (V3 | {"rope_scaling": {"type": "yarn", "factor": 4, "mscale_all_dim": 1.0}},
         r"mscale_all_dim=1.0 without mscale"),
        (V3 | {"rope_scaling": {"type": "linear", "factor": 4}}, r"rope_type='linear'"),
    ],
)  # fmt: skip
def test_what_mp_computes_otherwise_is_refused_on_import(config, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(config)


@pytest.mark.parametrize(
    ("model_type", "changes", "shapes", "message"),
    [
        ("deepseek_v3", {"moe_router_enable_expert_bias": False}, {},
         r"moe_router_enable_expert_bias=False: deepseek_v3 computes only"),
        ("deepseek_v3", {"moe_router_group_topk": 1}, {}, r"ranks a group by its 2 best"),
        ("deepseek_v2", {"moe_router_pre_softmax": False}, {},
         r"moe_router_pre_softmax=False: deepseek_v2 computes only"),
        ("deepseek_v3", {}, {"shared_ffn": 7}, r"shared experts are n_shared_experts x"),
        ("deepseek_v3", {}, {"sparse": [1, 0, 1]}, r"dense layers first, then expert layers"),
        ("deepseek_v2", {"qk_layernorm": False}, {}, r"qk_layernorm=False"),
        ("deepseek_v2", {"layernorm_epsilon": 1e-5}, {}, r"layernorm_epsilon=1e-05"),
    ],
)  # fmt: skip
def test_what_deepseek_computes_otherwise_is_refused_on_export(model_type, changes, shapes,
                                                               message):  # fmt: skip
    settings = model_config_from_hf(V3 if model_type == "deepseek_v3" else V2_LITE) | changes
    with pytest.raises(ValueError, match=message):
        family(model_type).config(settings, SHAPES | shapes, {}, "bfloat16")


@pytest.mark.parametrize(
    ("layers", "counted", "message"),
    [([3], 0, r"hold layers \[3\] past num_hidden_layers=3, where config.json counts "
               r"num_nextn_predict_layers=0"),
     ([4], 2, r"hold layers \[4\] past"), ([3, 4], 1, r"hold layers \[3, 4\] past")],
)  # fmt: skip
def test_layers_past_the_decoder_are_refused_unless_counted_as_mtp(layers, counted, message):
    state = {f"model.layers.{i}.eh_proj.weight": torch.zeros(16, 32) for i in layers}
    with pytest.raises(ValueError, match=message):
        logical_from_hf(state, V3 | {"num_nextn_predict_layers": counted})


def test_quantized_weights_are_refused(tmp_path):
    quantized = V3 | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    (tmp_path / "config.json").write_text(json.dumps(quantized))
    with pytest.raises(ValueError, match=r"quant_method 'fp8'\): mp imports unquantized"):
        import_hf(tmp_path, tmp_path / "ckpt")


def test_a_checkpoint_naming_no_family_exports_as_deepseek_v3_and_imports_back(tmp_path):
    """A checkpoint as training saves it (no family, settings without multi-latent
    attention's widths or the MTP module, which the tensors show) exports in bf16 as the
    family its settings describe, the router's correction bias kept in fp32 as
    transformers keeps it, the MTP module as DeepSeek's layer 3 with copies of the
    embedding and the output layer; import-hf gives back every tensor (in bf16 but that
    one), and refuses a copy that differs from what it repeats."""
    n, q, r, dn, dr, dv, e, f, s, ffn, h = 4, 8, 6, 4, 2, 3, 8, 5, 10, 24, 16
    shapes = {
        "input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_q_down_proj.weight": (q, h),
        "self_attention.q_layernorm.weight": (q,),
        "self_attention.linear_q_up_proj.weight": (n * (dn + dr), q),
        "self_attention.linear_kv_down_proj.weight": (r + dr, h),
        "self_attention.kv_layernorm.weight": (r,),
        "self_attention.linear_kv_up_proj.weight": (n * (dn + dv), r),
        "self_attention.linear_proj.weight": (h, n * dv),
    }  # fmt: skip
    dense = {"mlp.linear_fc1.gate.weight": (ffn, h), "mlp.linear_fc1.up.weight": (ffn, h),
             "mlp.linear_fc2.weight": (h, ffn)}  # fmt: skip
    moe = {
        "mlp.router.weight": (e, h), "mlp.router.expert_bias": (e,),
        "mlp.experts.linear_fc1.gate.weight": (e, f, h),
        "mlp.experts.linear_fc1.up.weight": (e, f, h), "mlp.experts.linear_fc2.weight": (e, h, f),
        "mlp.shared_experts.linear_fc1.gate.weight": (s, h),
        "mlp.shared_experts.linear_fc1.up.weight": (s, h),
        "mlp.shared_experts.linear_fc2.weight": (h, s),
    }  # fmt: skip
    names = {"embedding.word_embeddings.weight": (32, h), "output_layer.weight": (32, h),
             "decoder.final_layernorm.weight": (h,)}  # fmt: skip
    for i in range(3):
        names |= {f"decoder.layers.{i}.{k}": v for k, v in (shapes | (moe if i else dense)).items()}
    mtp = "mtp.layers.0."
    names |= {f"{mtp}transformer_layer.{k}": v for k, v in (shapes | moe).items()}
    names |= {f"{mtp}{k}.weight": (h,) for k in ("enorm", "hnorm", "final_layernorm")}
    names[f"{mtp}eh_proj.weight"] = (h, 2 * h)
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(shape, generator=gen) for k, shape in names.items()}
    widths = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    settings = {k: v for k, v in model_config_from_hf(V3).items() if k not in widths}
    pieces = {k: ShardedTensor(k, t, tuple(t.shape), (0,) * t.dim()) for k, t in tensors.items()}
    Checkpointer(tmp_path / "ckpt").save(0, pieces, common={"model_config": settings})

    export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype=torch.bfloat16)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == 1
    assert config["dtype"] == "bfloat16"
    assert [config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                "qk_rope_head_dim", "v_head_dim", "n_shared_experts")] == \
        [q, r, dn, dr, dv, 2]  # fmt: skip
    assert config["num_nextn_predict_layers"] == 1
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(hf["model.layers.3.shared_head.head.weight"], hf["lm_head.weight"])
    assert torch.equal(hf["model.layers.3.eh_proj.weight"],
                       tensors[f"{mtp}eh_proj.weight"].bfloat16())  # fmt: skip
    import_hf(tmp_path / "hf", tmp_path / "back")
    back = CheckpointReader(tmp_path / "back")
    assert set(back.keys) == set(tensors)
    for key, tensor in tensors.items():
        kept = key.endswith("expert_bias")
        assert back.dtype(key) == (torch.float32 if kept else torch.bfloat16), key
        assert torch.equal(back.read(key), tensor.to(back.dtype(key))), key
    hf["model.layers.3.embed_tokens.weight"][0, 0] += 1
    differs = r"layers\.3\.embed_tokens\.weight differs from the tensor it repeats \(mp's emb"
    with pytest.raises(ValueError, match=differs):
        logical_from_hf(hf, config)
