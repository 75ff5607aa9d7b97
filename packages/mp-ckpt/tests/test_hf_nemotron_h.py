"""Nemotron-H (Mamba-hybrid) <-> mp without transformers: config.json's older and current
forms read alike, what mp does not compute refused, in_proj and conv1d split by group and
fused back exactly, transformers' in-memory names (model.*, fused experts) imported as the
saved ones, a tied output layer exported as a copy, multi-token prediction layers (the
unified pattern, each sublayer as a decoder layer of its kind, one and two modules) both
ways, and such models to Megatron-LM and back (test_megatron_hybrid.py has megatron-core's
own files). tests/test_hf_families.py checks
the logits against transformers; here transformers only loads an export with multi-token
prediction layers, which it ignores."""

import json
import re

import pytest
import torch

from mp_ckpt import Checkpointer, CheckpointReader, ShardedTensor, import_megatron
from mp_ckpt.families import family, family_of
from mp_ckpt.families.table import Dims, split_hybrid_pattern
from mp_ckpt.hf import export_hf, logical_from_hf, model_config_from_hf
from mp_ckpt.hf.importer import held_config, placed_rules
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
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1"),
    ({"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "sliding_attention"]},
     "mtp_layers_block_type=.*not sliding_attention"),
    ({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*G"},
     "mtp_hybrid_override_pattern=.*not G"),
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


GN, EXPERTS = G * N, 4
KIND_SHAPES = {
    "M": {"mixer.in_proj.weight": (2 * INNER + 2 * GN + HEADS, H),
          "mixer.conv1d.weight": (INNER + 2 * GN, 1, 4), "mixer.conv1d.bias": (INNER + 2 * GN,),
          "mixer.dt_bias": (HEADS,), "mixer.A_log": (HEADS,), "mixer.D": (HEADS,),
          "mixer.norm.weight": (INNER,), "mixer.out_proj.weight": (H, INNER)},
    "-": {"mixer.up_proj.weight": (24, H), "mixer.down_proj.weight": (H, 24)},
    "*": {"mixer.q_proj.weight": (16, H), "mixer.k_proj.weight": (8, H),
          "mixer.v_proj.weight": (8, H), "mixer.o_proj.weight": (H, 16)},
    "E": {"mixer.gate.weight": (EXPERTS, H), "mixer.gate.e_score_correction_bias": (EXPERTS,),
          "mixer.shared_experts.up_proj.weight": (12, H),
          "mixer.shared_experts.down_proj.weight": (H, 12),
          **{f"mixer.experts.{e}.up_proj.weight": (8, H) for e in range(EXPERTS)},
          **{f"mixer.experts.{e}.down_proj.weight": (H, 8) for e in range(EXPERTS)}},
}  # fmt: skip
"""A layer's tensors but its norm, by its symbol (CONFIG's widths)."""
TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def saved_state(config: dict, module: str = "", depths: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the names transformers saves (backbone.*, experts one by one) of
    CONFIG's layers "M-*E", and `depths` multi-token prediction modules of the layers
    `module` (mtp.layers.{k L + j}.: sublayer j of module k, L = len(module))."""
    gen = torch.Generator().manual_seed(0)

    def layer(prefix: str, symbol: str) -> dict[str, torch.Tensor]:
        shapes = {"norm.weight": (H,)} | KIND_SHAPES[symbol]
        return {prefix + name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}

    state = {name: torch.randn(shape, generator=gen) for name, shape in (
        ("backbone.embeddings.weight", (VOCAB, H)), ("backbone.norm_f.weight", (H,)),
        ("lm_head.weight", (VOCAB, H)))}  # fmt: skip
    for i, symbol in enumerate("M-*E"):
        state |= layer(f"backbone.layers.{i}.", symbol)
    for k in range(depths):
        first, last = k * len(module), (k + 1) * len(module) - 1
        for j, symbol in enumerate(module):
            state |= layer(f"mtp.layers.{first + j}.", symbol)
        state |= {
            f"mtp.layers.{first}.{n}.weight": torch.randn(shape, generator=gen)
            for n, shape in (("enorm", (H,)), ("hnorm", (H,)), ("eh_proj", (H, 2 * H)))
        }
        state[f"mtp.layers.{last}.final_layernorm.weight"] = torch.randn(H, generator=gen)
    return state


def mtp_config(module: str, depths: int) -> dict:
    return CONFIG | {"num_nextn_predict_layers": depths,
                     "mtp_layers_block_type": [TYPES[s] for s in module]}  # fmt: skip


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


def through_megatron(tmp_path, logical: dict, settings: dict, tp: int = 1) -> dict:
    """mp -> export-megatron (torch_dist at `tp`) -> import-megatron: the tensors come back
    exactly; returns the settings recorded by the import."""
    export_megatron(checkpoint(tmp_path, logical, settings), tmp_path / "megatron",
                    tensor_model_parallel_size=tp)  # fmt: skip
    import_megatron(tmp_path / "megatron", tmp_path / "back")
    reader = CheckpointReader(tmp_path / "back")
    assert sorted(reader.keys) == sorted(logical)
    for key, tensor in logical.items():
        assert torch.equal(reader.read(key), tensor), key
    return torch.load(reader.directory / "common.pt", weights_only=False)["model_config"]


def test_a_nemotron_h_model_goes_to_megatron_and_back_exactly(tmp_path):
    """Hugging Face -> mp -> Megatron-LM (torch_dist, HybridModel's files at TP2) -> mp."""
    settings = model_config_from_hf(CONFIG)
    logical = logical_from_hf(saved_state(CONFIG), CONFIG)
    back = through_megatron(tmp_path, logical, settings, tp=2)
    for name in ("hybrid_layer_pattern", "mamba_num_heads", "mamba_head_dim",
                 "mamba_num_groups", "mamba_state_dim", "num_moe_experts",
                 "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias"):  # fmt: skip
        assert back[name] == settings[name], name


# --- multi-token prediction ---------------------------------------------------------------


def test_multi_token_prediction_settings_are_the_unified_pattern():
    legacy_names = {"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "moe"]}
    one = model_config_from_hf(CONFIG | legacy_names)
    assert one["hybrid_layer_pattern"] == "M-*E/*E"
    assert (one["num_layers"], one["mtp_num_layers"]) == (4, 1)
    assert "mtp_loss_scaling_factor" not in one  # (as DeepSeek-V3's import: mp's default)
    two = model_config_from_hf(mtp_config("*E", 2))
    assert (two["hybrid_layer_pattern"], two["mtp_num_layers"]) == ("M-*E/*E/*E", 2)
    # the older string, read where the list is absent (or transformers' default)
    older = CONFIG | {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}
    assert model_config_from_hf(older) == one
    assert model_config_from_hf(older | {"mtp_hybrid_override_pattern": "M*"}
                                )["hybrid_layer_pattern"] == "M-*E/M*"  # fmt: skip
    assert model_config_from_hf(older | {"mtp_layers_block_type": ["full_attention", "moe"],
                                         "mtp_hybrid_override_pattern": "-"}
                                )["hybrid_layer_pattern"] == "M-*E/-"  # fmt: skip
    assert model_config_from_hf(mtp_config("ME", 1) | {"mtp_hybrid_override_pattern": "-"}
                                )["hybrid_layer_pattern"] == "M-*E/ME"  # fmt: skip
    # transformers' default without either
    default = CONFIG | {"num_nextn_predict_layers": 1}
    assert model_config_from_hf(default)["hybrid_layer_pattern"] == "M-*E/*E"
    without = model_config_from_hf(CONFIG | {"num_nextn_predict_layers": 0,
                                             "mtp_layers_block_type": ["mamba"]})  # fmt: skip
    assert without == model_config_from_hf(CONFIG) and "mtp_num_layers" not in without


def test_a_pattern_with_unlike_modules_is_refused_naming_them():
    assert split_hybrid_pattern("M-*E") == ("M-*E", None, 0)
    assert split_hybrid_pattern("M-*E/") == ("M-*E", None, 0)
    assert split_hybrid_pattern("M-*E/*E/*E") == ("M-*E", "*E", 2)
    with pytest.raises(ValueError, match=r"module 0's are '\*E', module 1's 'ME'"):
        split_hybrid_pattern("M-*E/*E/ME")
    settings = model_config_from_hf(mtp_config("*E", 2)) | {"hybrid_layer_pattern": "M-*E/*E/E"}
    with pytest.raises(ValueError, match="must be alike"):
        list(placed_rules(family("nemotron_h"), settings))


@pytest.mark.parametrize(("module", "depths"), [("*E", 1), ("M*", 2), ("ME-", 1)])
def test_multi_token_prediction_layers_import_as_decoder_layers_and_export_back(
    tmp_path, module, depths
):
    from safetensors.torch import load_file

    config, size = mtp_config(module, depths), len(module)
    state = saved_state(CONFIG, module, depths)
    logical = logical_from_hf(state, config)
    # every name: the decoder's, and each sublayer's a decoder layer's of its kind
    decoder = logical_from_hf(saved_state(CONFIG), CONFIG)
    want = set(decoder)
    for k in range(depths):
        own = f"mtp.layers.{k}."
        want |= {own + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                   "final_layernorm.weight")}  # fmt: skip
        for j, symbol in enumerate(module):
            layer = f"decoder.layers.{'M-*E'.index(symbol)}."
            want |= {f"{own}mtp_model_layer.layers.{j}.{n.removeprefix(layer)}"
                     for n in decoder if n.startswith(layer)}  # fmt: skip
    assert set(logical) == want
    # the transforms of a decoder layer of the kind, at k L + j
    last = depths - 1
    hf, mp = f"mtp.layers.{last * size}.", f"mtp.layers.{last}."
    assert torch.equal(logical[mp + "eh_proj.weight"], state[hf + "eh_proj.weight"])
    assert torch.equal(logical[mp + "final_layernorm.weight"],
                       state[f"mtp.layers.{depths * size - 1}.final_layernorm.weight"])  # fmt: skip
    for j, symbol in enumerate(module):
        hf, sub = f"mtp.layers.{last * size + j}.", f"{mp}mtp_model_layer.layers.{j}."
        if symbol == "*":
            q = state[hf + "mixer.q_proj.weight"]
            assert torch.equal(logical[sub + "self_attention.linear_qkv.q.weight"],
                               q.reshape(2, 2, 4, H))  # fmt: skip
            assert torch.equal(logical[sub + "input_layernorm.weight"], state[hf + "norm.weight"])
        if symbol == "M":
            in_proj = state[hf + "mixer.in_proj.weight"]
            assert torch.equal(logical[sub + "mixer.in_proj.B.weight"][1],
                               in_proj[2 * INNER + N : 2 * INNER + GN])  # fmt: skip
            assert torch.equal(logical[sub + "norm.weight"], state[hf + "norm.weight"])
        if symbol == "E":
            up = torch.stack([state[f"{hf}mixer.experts.{e}.up_proj.weight"] for e in range(4)])
            assert torch.equal(logical[sub + "mlp.experts.linear_fc1.weight"], up)
            assert torch.equal(logical[sub + "pre_mlp_layernorm.weight"], state[hf + "norm.weight"])
    # a tensor of a sublayer past the modules, or a module's own at another sublayer: refused
    for extra in (f"mtp.layers.{depths * size}.norm.weight", "mtp.layers.1.enorm.weight"):
        with pytest.raises(ValueError, match=rf"no place for: {re.escape(extra)}"):
            logical_from_hf(state | {extra: torch.ones(H)}, config)

    settings = model_config_from_hf(config)
    out = export_hf(checkpoint(tmp_path, logical, settings), tmp_path / "hf")
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
    written = json.loads((out / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == depths
    assert written["mtp_layers_block_type"] == [TYPES[s] for s in module]
    assert written["layers_block_type"] == ["linear_attention", "mlp", "full_attention", "moe"]
    assert model_config_from_hf(written) == settings


def test_weights_without_multi_token_prediction_layers_import_without_them():
    """transformers saves no mtp.* tensors while config.json keeps counting them."""
    config = mtp_config("*E", 1)
    held = held_config(saved_state(CONFIG), config)
    assert held["num_nextn_predict_layers"] == 0
    assert not any(n.startswith("mtp.") for n in logical_from_hf(saved_state(CONFIG), config))
    assert held_config(saved_state(CONFIG, "*E", 1), config) == config
    with pytest.raises(KeyError, match=r"no tensor 'mtp\.layers\.2\.enorm\.weight'"):
        logical_from_hf(saved_state(CONFIG, "*E", 1), mtp_config("*E", 2))


def test_multi_token_prediction_layers_go_to_megatron_and_back_exactly(tmp_path):
    """Two modules of a Mamba and a MoE sublayer: Hugging Face -> mp -> Megatron-LM (the
    modules' layers under mtp.layers.{k}.mtp_model_layer.layers.{j}.) -> mp."""
    config = mtp_config("ME", 2)
    settings = model_config_from_hf(config)
    logical = logical_from_hf(saved_state(CONFIG, "ME", 2), config)
    back = through_megatron(tmp_path, logical, settings)
    assert (back["hybrid_layer_pattern"], back["mtp_num_layers"]) == ("M-*E/ME/ME", 2)


def test_transformers_loads_an_export_with_multi_token_prediction_layers_and_ignores_them(
    tmp_path,
):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    config = transformers.NemotronHConfig(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
        chunk_size=8, intermediate_size=80, max_position_embeddings=64,
        layers_block_type=["mamba", "moe", "full_attention", "mlp"], n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        num_nextn_predict_layers=1, mtp_layers_block_type=["mamba", "moe"])  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "hf_in")  # (no mtp.* tensors: transformers builds none)
    hf_config = json.loads((tmp_path / "hf_in" / "config.json").read_text())
    state = load_file(str(tmp_path / "hf_in" / "model.safetensors"))
    # the module's layers: the decoder's layers of their kind (0: Mamba, 1: experts), moved
    gen = torch.Generator().manual_seed(1)
    mtp = {}
    for j, i in enumerate((0, 1)):
        for name, tensor in state.items():
            if name.startswith(f"backbone.layers.{i}."):
                noise = torch.randn(tensor.shape, generator=gen)
                mtp[name.replace(f"backbone.layers.{i}.", f"mtp.layers.{j}.")] = tensor + noise
    mtp |= {
        f"mtp.layers.0.{n}.weight": torch.randn(shape, generator=gen)
        for n, shape in (("enorm", (64,)), ("hnorm", (64,)), ("eh_proj", (64, 128)))
    }
    mtp["mtp.layers.1.final_layernorm.weight"] = torch.randn(64, generator=gen)

    exports = {}
    for name, weights in (("with", state | mtp), ("without", state)):
        logical = logical_from_hf(weights, hf_config)
        held = held_config(weights, hf_config)
        exports[name] = export_hf(checkpoint(tmp_path / name, logical, model_config_from_hf(held)),
                                  tmp_path / f"hf_{name}")  # fmt: skip
    with_mtp = load_file(str(exports["with"] / "model.safetensors"))
    assert {n for n in with_mtp if n.startswith("mtp.")} == set(mtp)

    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name, folder in exports.items():
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, output_loading_info=True)  # fmt: skip
        assert not info["missing_keys"], info
        assert loaded.config.num_nextn_predict_layers == (name == "with")
        if name == "with":
            assert loaded.config.mtp_layers_block_type == ["linear_attention", "moe"]
        with torch.no_grad():
            logits[name] = loaded.eval()(x).logits
    assert torch.equal(logits["with"], logits["without"])
    with torch.no_grad():
        assert torch.allclose(logits["with"], model(x).logits, atol=1e-6, rtol=0)
