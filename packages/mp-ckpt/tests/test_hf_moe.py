"""Mixtral and Qwen2-MoE <-> mp, without transformers: config.json both ways and its
refusals, the two layouts of the experts giving the same logical tensors, and a
hand-written Hugging Face folder coming back tensor for tensor through import and export.
The same folders read straight into pieces (hf/lazy.py): what counts as a Hugging Face
directory, each piece (row halves, a flattened range) equal to the whole import's tensor
with the experts saved per expert or fused, only the wanted rules read, the refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mp_ckpt import Checkpointer, ShardedTensor, is_hf_directory, load_hf_pieces
from mp_ckpt.cli import main
from mp_ckpt.families.moe import is_moe_layer
from mp_ckpt.families.moe_settings import sparse_layers, sparse_step
from mp_ckpt.hf import logical_from_hf, model_config_from_hf
from mp_ckpt.hf.importer import iter_logical_from_hf
from mp_ckpt.hf.lazy import LazySafetensors

H, HEADS, GROUPS, E, F, S, FFN, VOCAB = 16, 4, 2, 4, 6, 10, 12, 32
D = H // HEADS

MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "dtype": "float32",
    "head_dim": D, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
    "intermediate_size": F, "max_position_embeddings": 64, "num_attention_heads": HEADS,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": GROUPS,
    "num_local_experts": E, "output_router_logits": False, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "sliding_window": None,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": VOCAB,
}  # fmt: skip
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "attention_dropout": 0.0,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "dtype": "float32",
    "decoder_sparse_step": 1, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
    "intermediate_size": FFN, "layer_types": ["full_attention"] * 3,
    "max_position_embeddings": 64, "max_window_layers": 28, "mlp_only_layers": [1],
    "moe_intermediate_size": F, "norm_topk_prob": False, "num_attention_heads": HEADS,
    "num_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": 3,
    "num_key_value_heads": GROUPS, "output_router_logits": False, "qkv_bias": True,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": S, "sliding_window": 0,
    "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
    "vocab_size": VOCAB,
}  # fmt: skip
CONFIGS = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}


def test_mixtral_settings():
    settings = model_config_from_hf(MIXTRAL)
    assert settings["num_moe_experts"] == E and settings["moe_router_topk"] == 2
    assert settings["moe_ffn_hidden_size"] == F and settings["ffn_hidden_size"] == F
    # softmax, top k, renormalize == top k of the logits, softmax over those k
    assert settings["moe_router_pre_softmax"] is False
    assert settings["moe_router_score_function"] == "softmax"
    assert settings["moe_aux_loss_coeff"] == 0.02
    assert settings["moe_router_load_balancing_type"] == "aux_loss"
    assert settings["moe_shared_expert_intermediate_size"] is None
    assert settings["moe_layer_freq"] == [1] and settings["rotary_base"] == 1000000
    assert not settings.get("add_qkv_bias")


def test_mixtral_defaults_are_mixtrals():
    config = {k: v for k, v in MIXTRAL.items() if k not in ("rope_parameters", "rms_norm_eps")}
    settings = model_config_from_hf(config)
    assert settings["rotary_base"] == 1000000 and settings["layernorm_epsilon"] == 1e-5


@pytest.mark.parametrize("norm, pre_softmax", [(False, True), (True, False)])
def test_qwen2_moe_settings(norm, pre_softmax):
    settings = model_config_from_hf(QWEN2_MOE | {"norm_topk_prob": norm})
    assert settings["moe_router_pre_softmax"] is pre_softmax
    assert settings["num_moe_experts"] == E and settings["moe_ffn_hidden_size"] == F
    assert settings["ffn_hidden_size"] == FFN
    assert settings["moe_shared_expert_intermediate_size"] == S
    assert settings["moe_shared_expert_gate"] is True and settings["add_qkv_bias"] is True
    assert settings["moe_layer_freq"] == [1, 0, 1]


@pytest.mark.parametrize(
    "layers, step, dense, pattern",
    [(4, 1, [], [1, 1, 1, 1]), (4, 2, [], [0, 1, 0, 1]), (6, 3, [], [0, 0, 1, 0, 0, 1]),
     (4, 1, [0, 3], [0, 1, 1, 0]), (4, 2, [3], [0, 1, 0, 0])],
)  # fmt: skip
def test_qwen2_moe_sparse_layers_and_back(layers, step, dense, pattern):
    # Qwen2-MoE: layer i is sparse iff i not in mlp_only_layers and (i + 1) % step == 0
    config = {"num_hidden_layers": layers, "decoder_sparse_step": step, "mlp_only_layers": dense}
    assert sparse_layers(config) == pattern
    assert sparse_step(pattern) == (step, dense)


@pytest.mark.parametrize(
    "freq, layers, pattern",
    [(1, 3, [1, 1, 1]), ([1], 3, [1, 1, 1]), ([2], 4, [1, 0, 1, 0]), (2, 3, [1, 0, 1]),
     ([1, 0, 1], 3, [1, 0, 1]), ([1], 1, [1])],
)  # fmt: skip
def test_moe_layer_freq_is_read_as_transformer_config_reads_it(freq, layers, pattern):
    settings = {"num_moe_experts": E, "num_layers": layers, "moe_layer_freq": freq}
    assert [int(is_moe_layer(settings, i)) for i in range(layers)] == pattern


@pytest.mark.parametrize(
    "arch, change, message",
    [
        ("mixtral", {"sliding_window": 4096}, "sliding_window=4096"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("mixtral", {"num_local_experts": 0}, "num_local_experts=0"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("qwen2_moe", {"layer_types": ["sliding_attention"] * 3}, "layer_types="),
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ("qwen2_moe", {"mlp_only_layers": [0, 1, 2]}, "mlp_only_layers=[0, 1, 2]: none"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0},
         "shared_expert_intermediate_size=0"),
        ("qwen2_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    ],
)  # fmt: skip
def test_import_refuses_what_mp_cannot_compute(arch, change, message):
    with pytest.raises(ValueError) as error:
        model_config_from_hf(CONFIGS[arch] | change)
    assert str(error.value).startswith("config.json ") and message in str(error.value)


# --- tensors ---


def _random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN)


_GEN = torch.Generator().manual_seed(0)


def hf_state(arch: str, fused: bool = False) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict of CONFIGS[arch]'s shapes, per expert or fused."""
    config = CONFIGS[arch]
    state = {"model.embed_tokens.weight": _random(VOCAB, H), "model.norm.weight": _random(H),
             "lm_head.weight": _random(VOCAB, H)}  # fmt: skip
    sparse = [1, 1] if arch == "mixtral" else sparse_layers(config)
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i, moe in enumerate(sparse):
        p = f"model.layers.{i}."
        for proj, rows in (("q", H), ("k", GROUPS * D), ("v", GROUPS * D)):
            state[f"{p}self_attn.{proj}_proj.weight"] = _random(rows, H)
            if arch == "qwen2_moe":
                state[f"{p}self_attn.{proj}_proj.bias"] = _random(rows)
        state[p + "self_attn.o_proj.weight"] = _random(H, H)
        state[p + "input_layernorm.weight"] = _random(H)
        state[p + "post_attention_layernorm.weight"] = _random(H)
        if not moe:
            for name, shape in (("gate_proj", (FFN, H)), ("up_proj", (FFN, H)),
                                ("down_proj", (H, FFN))):  # fmt: skip
                state[f"{p}mlp.{name}.weight"] = _random(*shape)
            continue
        block = p + ("block_sparse_moe." if arch == "mixtral" and not fused else "mlp.")
        state[block + "gate.weight"] = _random(E, H)
        gate, up, down = _random(E, F, H), _random(E, F, H), _random(E, H, F)
        if fused:
            state[block + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
            state[block + "experts.down_proj"] = down
        else:
            for e in range(E):
                for name, tensor in zip(names, (gate, up, down), strict=True):
                    state[f"{block}experts.{e}.{name}.weight"] = tensor[e].clone()
        if arch == "qwen2_moe":
            for name, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)),
                                ("down_proj", (H, S))):  # fmt: skip
                state[f"{block}shared_expert.{name}.weight"] = _random(*shape)
            state[block + "shared_expert_gate.weight"] = _random(1, H)
    return state


def to_fused(arch: str, state: dict) -> dict:
    """The same weights as transformers 5 holds them in memory: gate_up_proj, down_proj."""
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for key, tensor in state.items():
        if ".experts." not in key:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for i in range(CONFIGS[arch]["num_hidden_layers"]):
        block = f"model.layers.{i}." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        if block + "gate.weight" not in state:
            continue
        gate, up, down = (torch.stack([state[f"{block}experts.{e}.{n}.weight"] for e in range(E)])
                          for n in names)  # fmt: skip
        fused = f"model.layers.{i}.mlp.experts."
        out[fused + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[fused + "down_proj"] = down
    return out


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_per_expert_and_fused_layouts_give_the_same_logical_tensors(arch):
    state = hf_state(arch)
    per_expert = logical_from_hf(state, CONFIGS[arch])
    fused = logical_from_hf(to_fused(arch, state), CONFIGS[arch])
    assert per_expert.keys() == fused.keys()
    for key, tensor in per_expert.items():
        assert torch.equal(tensor, fused[key]), key
    # gate is w1 / gate_proj, up is w3 / up_proj, down is w2 / down_proj, stacked by expert
    block = "model.layers.0." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    ours = ("linear_fc1.gate", "linear_fc1.up", "linear_fc2")
    for name, mine in zip(names, ours, strict=True):
        stacked = per_expert[f"decoder.layers.0.mlp.experts.{mine}.weight"]
        assert stacked.shape[0] == E
        for e in range(E):
            assert torch.equal(stacked[e], state[f"{block}experts.{e}.{name}.weight"])
    assert torch.equal(
        per_expert["decoder.layers.0.mlp.router.weight"], state[block + "gate.weight"]
    )


def test_qwen2_moe_dense_layer_shared_expert_and_biases():
    state = hf_state("qwen2_moe")
    logical = logical_from_hf(state, QWEN2_MOE)
    assert "decoder.layers.1.mlp.router.weight" not in logical
    assert torch.equal(logical["decoder.layers.1.mlp.linear_fc1.gate.weight"],
                       state["model.layers.1.mlp.gate_proj.weight"])  # fmt: skip
    shared = "decoder.layers.2.mlp.shared_experts."
    assert torch.equal(logical[shared + "gate_weight"],
                       state["model.layers.2.mlp.shared_expert_gate.weight"])  # fmt: skip
    assert torch.equal(logical[shared + "linear_fc2.weight"],
                       state["model.layers.2.mlp.shared_expert.down_proj.weight"])  # fmt: skip
    q_bias = logical["decoder.layers.0.self_attention.linear_qkv.q.bias"]
    assert q_bias.shape == (GROUPS, HEADS // GROUPS, D)
    assert torch.equal(q_bias.reshape(-1), state["model.layers.0.self_attn.q_proj.bias"])


def test_import_names_a_missing_expert():
    state = hf_state("mixtral")
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(KeyError, match=r"experts\.3\.w2\.weight"):
        logical_from_hf(state, MIXTRAL)


def imported(tmp_path, arch: str, state: dict, config: dict) -> str:
    """import-hf of a folder holding `state` and `config`: the checkpoint's path."""
    (tmp_path / "hf").mkdir()
    save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    return str(tmp_path / "ckpt")


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("fused", [False, True])
def test_import_then_export_gives_back_every_tensor_and_config(tmp_path, arch, fused):
    state = hf_state(arch)
    checkpoint = imported(tmp_path, arch, to_fused(arch, state) if fused else state, CONFIGS[arch])
    assert main(["export-hf", checkpoint, str(tmp_path / "out"), "--arch", arch]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == state.keys()  # per expert, whichever layout came in
    for key, tensor in state.items():
        assert torch.equal(exported[key], tensor), key
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == CONFIGS[arch]


@pytest.mark.parametrize(
    "arch, field, value, message",
    [
        ("mixtral", "moe_router_pre_softmax", True, "moe_router_pre_softmax=True"),
        ("mixtral", "moe_router_score_function", "sigmoid", "moe_router_score_function='sigmoid'"),
        ("qwen2_moe", "moe_router_topk_scaling_factor", 2.5, "moe_router_topk_scaling_factor=2.5"),
        ("qwen2_moe", "moe_router_topk", None, "moe_router_topk=None"),
        ("mixtral", "moe_expert_capacity_factor", 1.0, "moe_expert_capacity_factor=1.0"),
        ("qwen2_moe", "moe_router_enable_expert_bias", True, "moe_router_enable_expert_bias=True"),
    ],
)  # fmt: skip
def test_export_refuses_a_routing_it_cannot_write(tmp_path, capsys, arch, field, value, message):
    checkpoint = imported(tmp_path, arch, hf_state(arch), CONFIGS[arch])
    common_path = tmp_path / "ckpt" / "iter_0000000" / "common.pt"
    common = torch.load(common_path, weights_only=False)
    common["model_config"][field] = value
    torch.save(common, common_path)
    assert main(["export-hf", checkpoint, str(tmp_path / "out"), "--arch", arch]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "config.json").exists()


def test_export_refuses_a_dense_layer_and_a_shared_expert_in_mixtral(tmp_path, capsys):
    checkpoint = imported(tmp_path, "qwen2_moe", hf_state("qwen2_moe"), QWEN2_MOE)
    assert main(["export-hf", checkpoint, str(tmp_path / "out"), "--arch", "mixtral"]) == 2
    err = capsys.readouterr().err
    assert "the mixtral export" in err and "has no place for" in err


# --- a Hugging Face directory read straight into pieces ---


def hf_dir(tmp_path, arch: str, state: dict, name: str = "hf"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS[arch]))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def test_what_is_a_hugging_face_directory(tmp_path):
    folder = hf_dir(tmp_path, "mixtral", hf_state("mixtral"))
    assert is_hf_directory(folder) and is_hf_directory(str(folder))
    assert not is_hf_directory(None) and not is_hf_directory(tmp_path / "absent")
    Checkpointer(tmp_path / "ckpt").save(1, {}, common={"iteration": 1})
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(CONFIGS["mixtral"]))
    assert not is_hf_directory(tmp_path / "ckpt")  # a tracker: an mp checkpoint
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert not is_hf_directory(tmp_path / "other")  # no model_type


def pieces_of(logical: dict[str, torch.Tensor]) -> dict[str, ShardedTensor]:
    """Each tensor as two halves of its rows, as two tensor-parallel ranks hold it, and the
    embedding also as a flattened range of its second half (a distributed optimizer's)."""
    pieces = {}
    for key, tensor in logical.items():
        for r, part in enumerate(tensor.chunk(2)):
            shape = tuple(tensor.shape)
            offset = (r * tensor.shape[0] // 2,) + (0,) * (tensor.dim() - 1)
            pieces[f"{key}.{r}"] = ShardedTensor(key, torch.zeros_like(part), shape, offset)
    vocab, h = logical["embedding.word_embeddings.weight"].shape
    pieces["flat"] = ShardedTensor("embedding.word_embeddings.weight", torch.zeros(5),
                                   (vocab, h), (vocab // 2, 0), flattened_range=(3, 8),
                                   local_shape=(vocab // 2, h))  # fmt: skip
    return pieces


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_pieces_equal_the_whole_import(tmp_path, arch, fused):
    state = hf_state(arch)
    want = logical_from_hf(state, CONFIGS[arch])
    folder = hf_dir(tmp_path, arch, to_fused(arch, state) if fused else state)
    pieces = pieces_of(want)
    common = load_hf_pieces(folder, pieces)
    assert common["family"] == arch and common["tokenizer"]["files"] == {}
    for piece in pieces.values():
        assert torch.equal(piece.data, piece.read_from(want[piece.key])), piece.key


def test_only_the_wanted_rules_are_read(tmp_path):
    folder = hf_dir(tmp_path, "mixtral", hf_state("mixtral"))
    state = LazySafetensors(folder)
    read = []

    def reading(value):
        read.append(value)
        return state.read(value)

    wanted = {"decoder.layers.1.mlp.experts.linear_fc2.weight"}
    got = dict(iter_logical_from_hf(state, CONFIGS["mixtral"], wanted=wanted.__contains__,
                                    read=reading))  # fmt: skip
    assert set(got) == wanted and len(read) == 4  # one per expert


def test_refusals_name_the_tensor(tmp_path):
    state = hf_state("mixtral")
    want = logical_from_hf(state, CONFIGS["mixtral"])
    extra = hf_dir(tmp_path, "mixtral", state | {"model.extra.weight": torch.zeros(2)}, "extra")
    with pytest.raises(ValueError, match=r"no place for: model\.extra\.weight"):
        load_hf_pieces(extra, pieces_of(want))
    del state["model.layers.1.self_attn.k_proj.weight"]
    lacking = hf_dir(tmp_path, "mixtral", state, "lacking")
    with pytest.raises(KeyError, match=r"no tensor .model\.layers\.1\.self_attn\.k_proj\.weight."):
        load_hf_pieces(lacking, pieces_of(want))
    full = hf_dir(tmp_path, "mixtral", hf_state("mixtral"), "full")
    more = pieces_of(want | {"decoder.layers.2.mlp.router.weight": torch.zeros(4, 2)})
    with pytest.raises(KeyError, match=r"needs decoder.layers.2.mlp.router.weight"):
        load_hf_pieces(full, more)
    (full / "model.safetensors").rename(full / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="import-hf"):
        load_hf_pieces(full, pieces_of(want))
