"""import-megatron without megatron: the unpickling allow-list, and each Megatron-LM
fixture (tests/assets/megatron, written by megatron-core) imported into mp's names."""

import os
import pickle
from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, UnsafePickleError, import_megatron, safe_load
from mp_ckpt.cli import main

ASSETS = Path(__file__).parent / "assets" / "megatron"
CASES = ["llama_torch_dist_tp1", "llama_torch_dist_tp2_distopt", "llama_torch_tp2",
         "llama_torch_tp4", "gpt2_torch_dist_tp1"]  # fmt: skip


class _Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_a_command_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": None, "model": _Hostile(marker)}, path)
    with pytest.raises(
        UnsafePickleError, match=r"model_optim_rng\.pt: refused global (os|posix)\.system"
    ):
        safe_load(path)
    assert not marker.exists()


def test_builtins_eval_is_refused_in_raw_bytes(tmp_path):
    data = b"cbuiltins\neval\n(S'1+1'\ntR."  # protocol 0: eval("1+1")
    assert pickle.loads(data) == 2  # what an unchecked load would do
    with pytest.raises(UnsafePickleError, match=r"common_state: refused global builtins\.eval"):
        safe_load(data, name="common_state")


def test_megatron_names_become_stand_ins_and_namespace_attributes(tmp_path):
    import argparse

    path = tmp_path / "args.pt"
    torch.save({"args": argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16)}, path)
    args = safe_load(path)["args"]
    assert args.num_layers == 2 and args.params_dtype is torch.bfloat16


@pytest.mark.parametrize("case", CASES)
def test_import_writes_mp_logical_tensors(case, tmp_path):
    reference = safe_load(ASSETS / case / "reference.pt")
    args = reference["args"]
    out = import_megatron(ASSETS / case, tmp_path / "mp")
    assert out.name == "iter_0000000"
    common = torch.load(out / "common.pt", weights_only=False)
    settings = common["model_config"]
    assert common["source_iteration"] == 2
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "normalization", "position_embedding_type"):  # fmt: skip
        assert settings[name] == args[name], name
    assert settings["vocab_size"] == reference["logits"].shape[-1]
    reader = CheckpointReader(tmp_path / "mp")
    keys = set(reader.keys)
    heads, h = args["num_attention_heads"], args["hidden_size"]
    groups = settings["num_query_groups"]
    d = settings["kv_channels"]
    for i in range(args["num_layers"]):
        prefix = f"decoder.layers.{i}."
        assert reader.shape(prefix + "self_attention.linear_qkv.q.weight") == (
            groups, heads // groups, d, h)  # fmt: skip
        assert reader.shape(prefix + "self_attention.linear_qkv.k.weight") == (groups, d, h)
        assert prefix + "input_layernorm.weight" in keys
        assert prefix + "pre_mlp_layernorm.weight" in keys
        if args["swiglu"]:
            assert reader.shape(prefix + "mlp.linear_fc1.gate.weight") == (
                args["ffn_hidden_size"], h)  # fmt: skip
    assert ("output_layer.weight" in keys) == bool(args["untie_embeddings_and_output_weights"])
    assert not any("_extra_state" in k or k.startswith("optimizer.") for k in keys)


def test_cli_imports_and_refuses_what_it_does_not_do(tmp_path, capsys):
    src = ASSETS / "llama_torch_tp2"
    assert main(["import-megatron", str(src), str(tmp_path / "out"), "--iteration", "2"]) == 0
    assert (tmp_path / "out" / "iter_0000000" / "mp_metadata.json").exists()
    assert main(["export-megatron", str(tmp_path / "out"), str(tmp_path / "o3")]) == 0
    assert main(["import-megatron", str(src), str(tmp_path / "o4"), "--iteration", "7"]) == 2
    assert "iter_0000007" in capsys.readouterr().err


GPT2_TOKENIZER = Path(__file__).parents[2] / "mp-data/tests/assets/tokenizers/gpt2"


def test_the_runs_gpt2_tokenizer_files_are_kept_when_they_are_here(tmp_path):
    import types

    from mp_ckpt.megatron.importer import tokenizer_from_megatron

    args = types.SimpleNamespace(tokenizer_type="GPT2BPETokenizer",
                                 vocab_file=str(GPT2_TOKENIZER / "vocab.json"),
                                 merge_file=str(GPT2_TOKENIZER / "merges.txt"))  # fmt: skip
    record = tokenizer_from_megatron(args)
    assert record["files"]["vocab.json"] == (GPT2_TOKENIZER / "vocab.json").read_bytes()
    assert record["eos_token_id"] is not None
    args.vocab_file = str(tmp_path / "elsewhere.json")
    assert tokenizer_from_megatron(args) is None
    assert tokenizer_from_megatron(types.SimpleNamespace(tokenizer_type="NullTokenizer")) is None


def _as_plain(value):
    """A safe_load result re-saved without the stand-ins (plain Namespace args)."""
    import argparse

    from mp_ckpt.megatron.safe_pickle import MegatronObject, Namespace

    if isinstance(value, Namespace):
        return argparse.Namespace(**{k: _as_plain(v) for k, v in vars(value).items()})
    if isinstance(value, MegatronObject):
        return value.value
    if isinstance(value, dict):
        return {k: _as_plain(v) for k, v in value.items()}
    return value


def test_legacy_pipeline_stages_number_their_layers_from_zero(tmp_path):
    """The TP2 fixture cut into two pipeline stages (mp_rank_TT_PPP, layers local to each
    stage) imports to the same tensors."""
    src = ASSETS / "llama_torch_tp2" / "iter_0000002"
    staged = tmp_path / "pp" / "iter_0000002"
    for t in range(2):
        state = _as_plain(safe_load(src / f"mp_rank_{t:02d}" / "model_optim_rng.pt"))
        state["args"].pipeline_model_parallel_size = 2  # the args say what the numbers mean
        model = state["model"]
        for stage in range(2):
            first = ("embedding.",) if stage == 0 else ()
            last = ("decoder.final_layernorm", "output_layer") if stage == 1 else ()
            layer = f"decoder.layers.{stage}."
            keep = {key.replace(layer, "decoder.layers.0.", 1): value
                    for key, value in model.items()
                    if key.startswith((layer, *first, *last))}  # fmt: skip
            folder = staged / f"mp_rank_{t:02d}_{stage:03d}"
            folder.mkdir(parents=True)
            torch.save({"args": state["args"], "iteration": 2, "model": keep},
                       folder / "model_optim_rng.pt")  # fmt: skip
    import_megatron(ASSETS / "llama_torch_tp2", tmp_path / "whole")
    import_megatron(staged, tmp_path / "staged")
    whole, cut = CheckpointReader(tmp_path / "whole"), CheckpointReader(tmp_path / "staged")
    assert sorted(whole.keys) == sorted(cut.keys)
    for key in whole.keys:
        torch.testing.assert_close(cut.read(key), whole.read(key), rtol=0, atol=0)


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(root)
    return {key: reader.read(key) for key in reader.keys}


def test_multi_latent_attention_under_the_te_specs_names_and_layout(tmp_path):
    """The DeepSeek-shaped fixtures (megatron-core's local spec) saved as its Transformer
    Engine spec would save them import to the same tensors: in torch_dist the latent norms
    fused into the up projections (linear_q_up_proj / linear_kv_up_proj.layer_norm_weight)
    and the dense layer's pre-MLP norm into linear_fc1; in the legacy files the down
    projection whole on every TP rank (TE's duplicated linear) instead of split (the
    multi-token prediction module's too). The Adam state of an MLA model is refused."""
    import dataclasses

    from mp_ckpt.megatron.logical import logical_from_megatron
    from mp_ckpt.megatron.read import MegatronTensors, read_megatron

    te_names = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
                "0.pre_mlp_layernorm.": "0.mlp.linear_fc1.layer_norm_"}  # fmt: skip
    model = read_megatron(ASSETS / "mla_moe_torch_dist_tp2")
    renamed = MegatronTensors()
    for key in model.tensors:
        te_key = next((key.replace(a, b) for a, b in te_names.items() if a in key), key)
        renamed.add(te_key, model.tensors.shape(key), model.tensors.dtype(key),
                    lambda k=key: model.tensors[k])  # fmt: skip
    assert len([k for k in renamed if "layer_norm_weight" in k]) == 5
    local, settings = logical_from_megatron(model)
    te, _ = logical_from_megatron(dataclasses.replace(model, tensors=renamed))
    assert settings["multi_latent_attention"] and settings["q_lora_rank"] == 8
    assert local.keys() == te.keys()
    assert all(torch.equal(local[k], te[k]) for k in local)

    case = "mla_moe_mtp_torch_tp2_ep2"
    src = ASSETS / case / "iter_0000002"
    states = {f.parent.name: _as_plain(safe_load(f)) for f in src.glob("*/model_optim_rng.pt")}
    down = [k for k in states["mp_rank_00_000"]["model"] if k.endswith("kv_down_proj.weight")]
    whole = {key: torch.cat([states[f"mp_rank_{t:02d}_000"]["model"][key] for t in range(2)])
             for key in down}  # fmt: skip
    for name, state in states.items():  # mp_rank_<tp>_<ep>
        state["model"] |= whole
        (tmp_path / "te" / "iter_0000002" / name).mkdir(parents=True)
        torch.save(state, tmp_path / "te" / "iter_0000002" / name / "model_optim_rng.pt")
    assert len(down) == 3  # two decoder layers and the MTP module's
    assert states["mp_rank_01_000"]["model"][down[0]].shape == (12, 16)
    import_megatron(ASSETS / case, tmp_path / "local")
    import_megatron(tmp_path / "te" / "iter_0000002", tmp_path / "te_mp")
    want, got = _tensors(tmp_path / "local"), _tensors(tmp_path / "te_mp")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(ValueError, match="optimizer: no torch optimizer state"):  # model only
        import_megatron(ASSETS / case, tmp_path / "adam", with_optimizer=True)


def test_llama4_settings_are_recorded_as_megatron_ran_them(tmp_path):
    """The Llama 4-shaped fixture records Megatron's interleaved rotary pairs, Llama 3's
    rotary scaling, NoPE layers, query/key L2 norms and routing weights on the experts'
    input as they were given; the norms have no weights, and the MoE layers are the first
    and the third (--moe-layer-freq 2)."""
    case = "llama4_moe_torch_dist_tp2"
    args = safe_load(ASSETS / case / "reference.pt")["args"]
    out = import_megatron(ASSETS / case, tmp_path / "mp")
    settings = torch.load(out / "common.pt", weights_only=False)["model_config"]
    for name in ("rotary_interleaved", "use_rope_scaling", "rope_scaling_factor", "rotary_base",
                 "no_rope_freq", "qk_l2_norm", "moe_apply_probs_on_input"):  # fmt: skip
        assert settings[name] == args[name], name
    assert settings["moe_router_topk"] == 1
    keys = set(CheckpointReader(tmp_path / "mp").keys)
    assert [i for i in range(4) if f"decoder.layers.{i}.mlp.router.weight" in keys] == [0, 2]
    assert not any("layernorm" in k and "self_attention" in k for k in keys)
