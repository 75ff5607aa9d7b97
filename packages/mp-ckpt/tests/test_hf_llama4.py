"""Llama 4's text model <-> mp, without transformers: config.json to settings (NoPE layers
the other way round, the query/key norm on the rotating layers, the expert layers,
chunked attention and temperature tuning), the export writing it back, the fused
experts' layout, the refusals; the Megatron conversion carrying the new settings (and
refusing what Megatron-LM cannot run)."""

import pytest
import torch

from mp_ckpt.families import family, family_of
from mp_ckpt.families.table import Dims
from mp_ckpt.hf import logical_from_hf, model_config_from_hf
from mp_ckpt.megatron.settings import model_config_from_megatron
from mp_ckpt.megatron.write import megatron_args

H, HEADS, GROUPS, D, E, F, FFN, VOCAB, LAYERS = 16, 4, 2, 8, 4, 6, 12, 32, 4

SCOUT = {
    "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
    "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0,
    "attn_scale": 0.1, "attn_temperature_tuning": True, "bos_token_id": 1, "dtype": "float32",
    "eos_token_id": 2, "floor_scale": 8192, "head_dim": D, "hidden_act": "silu",
    "hidden_size": H, "initializer_range": 0.02, "interleave_moe_layer_step": 1,
    "intermediate_size": F, "intermediate_size_mlp": FFN,
    "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
    "max_position_embeddings": 10485760, "moe_layers": [0, 1, 2, 3],
    "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0], "num_attention_heads": HEADS,
    "num_experts_per_tok": 1, "num_hidden_layers": LAYERS, "num_key_value_heads": GROUPS,
    "num_local_experts": E, "output_router_logits": False, "pad_token_id": None,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
                        "rope_type": "llama3"},
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "tie_word_embeddings": False,
    "use_cache": True, "use_qk_norm": True, "vocab_size": VOCAB,
}  # fmt: skip
MAVERICK = SCOUT | {"interleave_moe_layer_step": 2, "moe_layers": [1, 3], "use_qk_norm": False}


def test_scout_settings():
    settings = model_config_from_hf(SCOUT)
    assert settings["rotary_interleaved"] is True
    assert settings["no_rope_freq"] == [0, 0, 0, 1]  # transformers' 1: rotates; mp's: does not
    assert (settings["qk_l2_norm"], settings["qk_l2_norm_layers"]) == (True, "rope")
    assert settings["moe_layer_freq"] == [1, 1, 1, 1]
    assert (settings["moe_router_score_function"], settings["moe_router_topk"]) == ("sigmoid", 1)
    assert settings["moe_apply_probs_on_input"] is True
    assert settings["moe_ffn_hidden_size"] == settings["moe_shared_expert_intermediate_size"] == F
    assert settings["moe_shared_expert_gate"] is False and settings["ffn_hidden_size"] == FFN
    assert (settings["use_rope_scaling"], settings["rope_scaling_factor"]) == (True, 16.0)
    assert settings["rope_scaling_original_max_position_embeddings"] == 8192
    assert settings["max_position_embeddings"] == 10485760
    assert settings["attention_chunk_size"] == 8192
    assert (settings["attn_temperature_floor_scale"], settings["attn_temperature_scale"]) == (
        8192, 0.1)  # fmt: skip
    assert family_of(settings) == "llama4_text"


def test_maverick_settings_and_the_defaults_config_json_may_leave_out():
    settings = model_config_from_hf(MAVERICK)
    assert settings["moe_layer_freq"] == [0, 1, 0, 1]
    assert (settings["qk_l2_norm"], settings["qk_l2_norm_layers"]) == (False, "all")
    assert family_of(settings) == "llama4_text"
    left_out = ("head_dim", "moe_layers", "no_rope_layers", "layer_types", "rope_parameters")
    bare = {k: v for k, v in MAVERICK.items() if k not in left_out}
    settings = model_config_from_hf(bare)
    assert settings["kv_channels"] == 128  # Llama 4's head_dim, not hidden / heads
    assert settings["moe_layer_freq"] == [0, 1, 0, 1]  # interleave_moe_layer_step 2
    assert settings["no_rope_freq"] == [0, 0, 0, 1]  # no_rope_layer_interval 4
    assert (settings["rotary_base"], settings["use_rope_scaling"]) == (500000, False)


def test_chunked_attention_and_temperature_tuning_where_they_apply():
    """Chunks where a layer rotates, the temperature where one does not and tuning is on."""
    rotating = model_config_from_hf(SCOUT | {"no_rope_layers": [1] * 4, "layer_types": None})
    assert rotating["attention_chunk_size"] == 8192
    assert rotating["attn_temperature_floor_scale"] is None
    off = model_config_from_hf(SCOUT | {"attn_temperature_tuning": False, "floor_scale": 4})
    assert (off["attn_temperature_floor_scale"], off["attn_temperature_scale"]) == (None, 0.1)
    tuned = model_config_from_hf(SCOUT | {"floor_scale": 6, "attn_scale": 0.5,
                                          "attention_chunk_size": 100})  # fmt: skip
    assert (tuned["attn_temperature_floor_scale"], tuned["attn_temperature_scale"]) == (6, 0.5)
    assert tuned["attention_chunk_size"] == 100
    with pytest.raises(ValueError, match=r"attention_chunk_size=0: expected a positive"):
        model_config_from_hf(SCOUT | {"attention_chunk_size": 0})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama4"}, r"model_type 'llama4' is Llama 4's image-and-text model"),
        ({"num_experts_per_tok": 2}, r"num_experts_per_tok=2: .* one expert per token"),
        ({"layer_types": ["full_attention"] * 4}, r"layer_types=.*chunked attention where"),
        ({"no_rope_layers": [1, 2, 1, 0]}, r"no_rope_layers=\[1, 2, 1, 0\]: expected a 0 or 1"),
        ({"moe_layers": []}, r"none of the 4 layers has experts"),
        ({"attention_bias": True}, r"attention_bias=True: mp computes only"),
    ],
)
def test_config_json_refusals(change, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(SCOUT | change)


def _shapes(settings: dict) -> dict:
    sparse = settings["moe_layer_freq"]
    return {"vocab": VOCAB, "hidden": H, "layers": LAYERS, "heads": HEADS, "groups": GROUPS,
            "head_dim": D, "tied": False, "ffn": FFN if not all(sparse) else None,
            "experts": E, "expert_ffn": F, "shared_ffn": F, "sparse": sparse}  # fmt: skip


@pytest.mark.parametrize("config", [SCOUT, MAVERICK], ids=["scout", "maverick"])
def test_the_export_writes_the_config_back(config):
    fam = family("llama4_text")
    settings = fam.settings(config)
    tokens = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    assert fam.config(settings, _shapes(settings), tokens, "float32") == config


def test_the_export_writes_the_intervals_that_give_the_layers():
    fam = family("llama4_text")
    settings = fam.settings(SCOUT | {"no_rope_layers": [1, 0, 1, 1], "layer_types": None})
    config = fam.config(settings, _shapes(settings), {}, "float32")
    assert (config["no_rope_layers"], config["no_rope_layer_interval"]) == ([1, 0, 1, 1], 4)
    settings |= {"no_rope_freq": 2, "moe_layer_freq": [0, 0, 0, 1]}
    config = fam.config(settings, _shapes(settings), {}, "float32")
    assert (config["no_rope_layers"], config["no_rope_layer_interval"]) == ([1, 0, 1, 0], 2)
    assert (config["moe_layers"], config["interleave_moe_layer_step"]) == ([3], 4)


def test_the_export_writes_mp_layers_chunked_attention_and_temperature_tuning():
    fam = family("llama4_text")
    settings = fam.settings(SCOUT) | {"attention_chunk_size": 64,
                                      "attn_temperature_floor_scale": 32,
                                      "attn_temperature_scale": 0.5}  # fmt: skip
    config = fam.config(settings, _shapes(settings), {}, "float32")
    assert (config["attention_chunk_size"], config["floor_scale"]) == (64, 32)
    assert (config["attn_temperature_tuning"], config["attn_scale"]) == (True, 0.5)
    settings |= {
        "attention_chunk_size": None,
        "attn_temperature_floor_scale": None,
        "attn_temperature_scale": 0.1,
    }
    config = fam.config(settings, _shapes(settings), {}, "float32")  # as mp computes them
    assert config["attention_chunk_size"] == config["max_position_embeddings"]
    assert config["attn_temperature_tuning"] is False
    settings["attention_chunk_size"] = 64
    with pytest.raises(ValueError, match=r"attention_chunk_size=64: mixtral computes only"):
        family("mixtral").config(
            settings | {"rotary_interleaved": False, "no_rope_freq": None, "qk_l2_norm": False,
                        "moe_apply_probs_on_input": False, "moe_router_score_function": "softmax"},
            _shapes(settings), {}, "float32")  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"qk_l2_norm_layers": "all"}, r"qk_l2_norm_layers='all' with layers without rotary"),
        ({"rotary_interleaved": False}, r"rotary_interleaved=False: llama4_text computes only"),
        ({"moe_apply_probs_on_input": False}, r"moe_apply_probs_on_input=False: llama4_text"),
        ({"moe_router_score_function": "softmax"}, r"moe_router_score_function='softmax'"),
    ],
)
def test_export_refusals(change, message):
    fam = family("llama4_text")
    settings = fam.settings(SCOUT)
    with pytest.raises(ValueError, match=message):
        fam.config(settings | change, _shapes(settings), {}, "float32")
    with pytest.raises(ValueError, match=r"shared expert is as wide as its experts \(6\)"):
        fam.config(settings, _shapes(settings) | {"shared_ffn": 2 * F}, {}, "float32")


def test_other_families_refuse_llama4s_settings():
    settings = model_config_from_hf(SCOUT)
    with pytest.raises(ValueError, match=r"rotary_interleaved=True: mixtral computes only"):
        family("mixtral").config(settings | {"moe_router_score_function": "softmax"},
                                 _shapes(settings), {}, "float32")  # fmt: skip
    # nor a latent MoE (Nemotron 3's, which only nemotron_h writes)
    plain = {"rotary_interleaved": False, "no_rope_freq": None, "qk_l2_norm": False,
             "moe_apply_probs_on_input": False, "moe_router_score_function": "softmax",
             "attention_chunk_size": None, "attn_temperature_floor_scale": None}  # fmt: skip
    with pytest.raises(ValueError, match=r"moe_latent_size=16: mixtral computes only"):
        family("mixtral").config(settings | plain | {"moe_latent_size": 16},
                                 _shapes(settings), {}, "float32")  # fmt: skip


def _hf_state() -> dict[str, torch.Tensor]:
    """Random tensors of a Scout-shaped Llama4ForCausalLM (every layer with experts)."""
    ff = "feed_forward."
    per_layer = {
        "self_attn.q_proj.weight": (HEADS * D, H), "self_attn.k_proj.weight": (GROUPS * D, H),
        "self_attn.v_proj.weight": (GROUPS * D, H), "self_attn.o_proj.weight": (H, HEADS * D),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        ff + "router.weight": (E, H), ff + "experts.gate_up_proj": (E, H, 2 * F),
        ff + "experts.down_proj": (E, F, H), ff + "shared_expert.gate_proj.weight": (F, H),
        ff + "shared_expert.up_proj.weight": (F, H), ff + "shared_expert.down_proj.weight": (H, F),
    }  # fmt: skip
    shapes = {f"model.layers.{i}.{name}": shape
              for i in range(LAYERS) for name, shape in per_layer.items()}  # fmt: skip
    shapes |= {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,),
               "lm_head.weight": (VOCAB, H)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def test_the_fused_experts_are_the_gate_then_the_up_columns_transposed():
    state = _hf_state()
    logical = logical_from_hf(state, SCOUT)
    fused = state["model.layers.2.feed_forward.experts.gate_up_proj"]
    mlp = "decoder.layers.2.mlp."
    assert torch.equal(logical[mlp + "experts.linear_fc1.gate.weight"], fused[:, :, :F].mT)
    assert torch.equal(logical[mlp + "experts.linear_fc1.up.weight"], fused[:, :, F:].mT)
    down = state["model.layers.2.feed_forward.experts.down_proj"]
    assert torch.equal(logical[mlp + "experts.linear_fc2.weight"], down.mT)
    q = logical["decoder.layers.0.self_attention.linear_qkv.q.weight"]
    assert torch.equal(q.reshape(-1, H), state["model.layers.0.self_attn.q_proj.weight"])
    fam, settings = family("llama4_text"), model_config_from_hf(SCOUT)
    for rule in fam.rules_for("moe", settings):  # and back
        names = [n.replace("{i}", "2") for n in rule.hf_names]
        back = rule.export([logical["decoder.layers.2." + n] for n in rule.mp], Dims.of(settings))
        assert all(torch.equal(b, state[n]) for b, n in zip(back, names, strict=True))


@pytest.mark.parametrize(
    "setting",
    [{"qk_l2_norm": True}, {"no_rope_freq": [0, 1, 0, 1], "num_moe_experts": 4},
     {"moe_apply_probs_on_input": True}, {"rotary_interleaved": True, "num_moe_experts": 4}],
)  # fmt: skip
def test_family_of_reads_llama4s_settings_as_llama4(setting):
    assert family_of({"position_embedding_type": "rope", **setting}) == "llama4_text"
    # a dense model rotating channel pairs: ERNIE 4.5's (Llama's export refuses the pairs)
    dense = {"position_embedding_type": "rope", "rotary_interleaved": True}
    assert family_of(dense) == "ernie4_5"
    # NoPE layers in a dense model without Llama 4's other features: SmolLM3's
    nope = {"position_embedding_type": "rope", "no_rope_freq": [0, 1, 0, 1]}
    assert family_of(nope) == "smollm3"


def test_megatron_args_carry_llama4s_settings_both_ways():
    imported = model_config_from_hf(SCOUT)
    for name in ("attention_chunk_size", "attn_temperature_floor_scale"):
        with pytest.raises(ValueError, match=f"{name}=8192: Megatron-LM has no such attention"):
            megatron_args(imported | {"qk_l2_norm_layers": "all"}
                          | {n: None for n in ("attention_chunk_size",
                                               "attn_temperature_floor_scale") if n != name},
                          ckpt_format="torch", tp=1, pp=1, iteration=0)  # fmt: skip
    # Megatron-LM's own Llama 4: full attention, no temperature, every layer normalized
    settings = imported | {"qk_l2_norm_layers": "all", "attention_chunk_size": None,
                           "attn_temperature_floor_scale": None}  # fmt: skip
    args = megatron_args(settings, ckpt_format="torch_dist", tp=1, pp=1, iteration=0)
    assert (args.rotary_interleaved, args.qk_l2_norm) == (True, True)
    assert args.no_rope_freq == [0, 0, 0, 1]
    assert args.moe_apply_probs_on_input is True and args.moe_router_score_function == "sigmoid"
    back = model_config_from_megatron(args, VOCAB)
    carried = ("rotary_interleaved", "no_rope_freq", "qk_l2_norm", "moe_apply_probs_on_input",
               "moe_router_score_function", "moe_shared_expert_intermediate_size")  # fmt: skip
    assert {f: back[f] for f in carried} == {f: settings[f] for f in carried}
    with pytest.raises(ValueError, match=r"qk_l2_norm_layers='rope': Megatron-LM normalizes"):
        megatron_args(settings | {"qk_l2_norm_layers": "rope"}, ckpt_format="torch_dist", tp=1,
                      pp=1, iteration=0)  # fmt: skip
    # without NoPE layers "rope" is every layer: Megatron computes it
    rotating = settings | {"qk_l2_norm_layers": "rope", "no_rope_freq": None}
    assert megatron_args(rotating, ckpt_format="torch", tp=1, pp=1, iteration=0).qk_l2_norm
