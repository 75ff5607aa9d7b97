"""export-megatron: mp -> Megatron-LM -> mp is tensor-exact for each fixture, format,
TP and PP; the written files are what Megatron's loader reads; clear refusals."""

from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, export_hf, import_megatron, safe_load
from mp_ckpt.cli import main
from mp_ckpt.megatron.read import read_megatron
from mp_ckpt.megatron.write import export_megatron

ASSETS = Path(__file__).parent / "assets" / "megatron"
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _mp(case: str, tmp_path: Path) -> Path:
    import_megatron(ASSETS / case, tmp_path / "mp")
    return tmp_path / "mp"


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(root)
    return {k: reader.read(k) for k in reader.keys}


def _settings(root: Path) -> dict:
    directory = CheckpointReader(root).directory
    return torch.load(directory / "common.pt", weights_only=False)["model_config"]


CASES = ["llama_torch_dist_tp1", "gpt2_torch_dist_tp1", "llama_torch_pp2"]


def _round_trip(case: str, fmt: str, tp: int, pp: int, ep: int, tmp_path: Path):
    """mp -> export-megatron -> import-megatron: every tensor and setting comes back; the
    Megatron checkpoint read back."""
    src = _mp(case, tmp_path)
    out = export_megatron(
        src, tmp_path / "meg", ckpt_format=fmt, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
    )  # fmt: skip
    assert out.name == "iter_0000000"
    assert (tmp_path / "meg" / "latest_checkpointed_iteration.txt").read_text() == "0"
    import_megatron(tmp_path / "meg", tmp_path / "back")
    before, after = _tensors(src), _tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key
    assert _settings(src) == _settings(tmp_path / "back")
    model = read_megatron(tmp_path / "meg")
    assert model.checkpoint_version == 3.0 and model.format == fmt
    assert model.args.tensor_model_parallel_size == tp
    assert model.args.pipeline_model_parallel_size == pp
    assert model.args.expert_model_parallel_size == ep
    assert model.args.ckpt_format == fmt
    return model


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_round_trip_is_tensor_exact(case, fmt, tp, pp, tmp_path):
    _round_trip(case, fmt, tp, pp, 1, tmp_path)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_fewer_query_groups_than_tp_ranks_round_trip(fmt, tmp_path):
    """The llama fixture's 2 query groups at TP4: Megatron-LM's files hold each rank's
    contiguous quarter of the fused QKV weight, half a group each."""
    _round_trip("llama_torch_dist_tp1", fmt, 4, 1, 1, tmp_path)


def test_torch_dist_files_mirror_megatron(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    out = export_megatron(_mp("llama_torch_dist_tp1", tmp_path), tmp_path / "meg")
    assert (out / "metadata.json").read_text() == (
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    )
    ours = FileSystemReader(out).read_metadata().state_dict_metadata
    theirs = FileSystemReader(ASSETS / "llama_torch_dist_tp1" / "iter_0000002")
    theirs = theirs.read_metadata().state_dict_metadata
    model_keys = {k for k in theirs if not k.startswith(("optimizer.", "rng_state"))}
    assert set(ours) == model_keys
    for key in model_keys:
        if hasattr(theirs[key], "size"):
            assert tuple(ours[key].size) == tuple(theirs[key].size), key


def test_legacy_files_mirror_megatron(tmp_path):
    out = export_megatron(_mp("llama_torch_tp2", tmp_path), tmp_path / "meg", ckpt_format="torch",
                          tensor_model_parallel_size=2)  # fmt: skip
    for rank in range(2):
        ours = safe_load(out / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")
        theirs = safe_load(ASSETS / "llama_torch_tp2" / "iter_0000002" / f"mp_rank_{rank:02d}"
                           / "model_optim_rng.pt")  # fmt: skip
        assert "optimizer" not in ours and ours["checkpoint_version"] == 3.0
        assert ours["model"].keys() == theirs["model"].keys()
        for key, value in theirs["model"].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(ours["model"][key], value), key


def test_pickles_need_only_builtins_and_torch(tmp_path):
    out = export_megatron(_mp("gpt2_torch_dist_tp1", tmp_path), tmp_path / "meg",
                          ckpt_format="torch")  # fmt: skip
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(out / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert state["args"].num_layers == 2 and state["iteration"] == 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tensor-model-parallel-size", "3"], "does not divide num_attention_heads 4"),
        (["--pipeline-model-parallel-size", "4"], "does not divide num_layers 2"),
    ],
)
def test_cli_refusals_are_one_line(argv, message, tmp_path, capsys):
    src = _mp("llama_torch_dist_tp1", tmp_path)
    assert main(["export-megatron", str(src), str(tmp_path / "meg"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_cli_writes(tmp_path, capsys):
    src = _mp("llama_torch_dist_tp1", tmp_path)
    assert main(["export-megatron", str(src), str(tmp_path / "meg"), "--ckpt-format", "torch",
                 "--tensor-model-parallel-size", "2"]) == 0  # fmt: skip
    assert "no-load-optim" in capsys.readouterr().out
    assert (tmp_path / "meg" / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt").exists()


def test_what_export_refuses():
    from mp_ckpt.megatron.export_checks import check_exportable as _check

    settings = {"num_attention_heads": 4, "num_query_groups": 2, "num_layers": 2,
                "vocab_size": 128, "ffn_hidden_size": 64}  # fmt: skip
    with pytest.raises(ValueError, match="no num_moe_experts"):
        _check(settings, {"decoder.layers.0.mlp.experts.linear_fc2.weight": None}, 1, 1,
               "torch_dist")  # fmt: skip
    with pytest.raises(ValueError, match="does not divide num_moe_experts 6"):
        _check(settings | {"num_moe_experts": 6}, {}, 1, 1, "torch", ep=4)
    with pytest.raises(ValueError, match="does not divide moe_ffn_hidden_size 6"):
        _check(settings | {"num_moe_experts": 4, "moe_ffn_hidden_size": 6}, {}, 4, 1, "torch")
    with pytest.raises(ValueError, match="the model has no experts"):
        _check(settings, {}, 1, 1, "torch", ep=2)
    _check(settings | {"num_attention_heads": 8}, {}, 4, 1, "torch")  # 2 ranks per group
    with pytest.raises(ValueError, match="neither divides num_query_groups 6 nor is a mult"):
        _check(settings | {"num_attention_heads": 12, "num_query_groups": 6}, {}, 4, 1, "torch")
    with pytest.raises(ValueError, match=r"^moe_latent_size=16: mp does not write latent MoE"):
        _check(settings | {"num_moe_experts": 4, "moe_latent_size": 16}, {}, 1, 1, "torch")
    mla = settings | {"num_query_groups": 4, "multi_latent_attention": True, "q_lora_rank": 6,
                      "kv_lora_rank": 8, "qk_pos_emb_head_dim": 4}  # fmt: skip
    _check(mla, {}, 2, 1, "torch")
    _check(mla, {}, 4, 1, "torch_dist")  # global tensors: Megatron's load splits them
    _check(mla | {"layernorm_epsilon": 1e-6, "latent_norm_epsilon": 1e-6}, {}, 1, 1, "torch")
    dsa = mla | {"experimental_attention_variant": "dsa", "dsa_indexer_topk_freq": 2}
    with pytest.raises(ValueError, match=r"^dsa_indexer_topk_freq=2 with layers megatron-co"):
        _check(dsa, {}, 1, 1, "torch_dist")
    _check(dsa, {}, 1, 1, "torch")
    _check(dsa | {"moe_layer_freq": [0, 1]}, {}, 1, 1, "torch_dist")  # layers apart
    with pytest.raises(ValueError, match=r"^latent_norm_epsilon=1e-06 beside layernorm_eps"):
        _check(mla | {"layernorm_epsilon": 1e-5, "latent_norm_epsilon": 1e-6}, {}, 1, 1, "torch")
    with pytest.raises(ValueError, match="does not divide the 6 rows of linear_q_down_proj"):
        _check(mla, {}, 4, 1, "torch")
    from mp_ckpt.megatron.write import megatron_args

    mla |= {"hidden_size": 32, "kv_channels": 8, "max_position_embeddings": 16}
    args = megatron_args(mla, ckpt_format="torch", tp=1, pp=1, iteration=0)
    assert (args.rope_type, args.q_lora_rank, args.rotary_scaling_factor) == ("yarn", 6, 1.0)
    with pytest.raises(ValueError, match=r"yarn_beta_fast=8\.0: Megatron's multi-latent"):
        megatron_args(mla | {"yarn_beta_fast": 8.0}, ckpt_format="torch", tp=1, pp=1,
                      iteration=0)  # fmt: skip


MOE_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 4)]


@pytest.mark.parametrize("case", ["moe_torch_dist_ep2", "moe_torch_ep2"])
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("tp,pp,ep", MOE_LAYOUTS)
def test_moe_round_trip_is_tensor_exact(case, fmt, tp, pp, ep, tmp_path):
    model = _round_trip(case, fmt, tp, pp, ep, tmp_path)
    assert model.args.moe_layer_freq == [1, 0]  # layer 0 MoE, layer 1 dense


def _with_setting(root: Path, field: str, value) -> None:
    path = CheckpointReader(root).directory / "common.pt"
    common = torch.load(path, weights_only=False)
    common["model_config"][field] = value
    torch.save(common, path)


def test_layernorm_1p_goes_to_megatron_and_back(tmp_path):
    """Megatron's --apply-layernorm-1p stores the same zero-centered weight as mp."""
    src = _mp("llama_torch_dist_tp1", tmp_path)
    _with_setting(src, "apply_layernorm_1p", True)
    export_megatron(src, tmp_path / "meg", ckpt_format="torch_dist")
    assert read_megatron(tmp_path / "meg").args.apply_layernorm_1p is True
    import_megatron(tmp_path / "meg", tmp_path / "back")
    assert _settings(tmp_path / "back")["apply_layernorm_1p"] is True


@pytest.mark.parametrize(
    ("field", "value"),
    [("quick_geglu", True), ("glu_linear_offset", 1.0), ("activation_func_clamp_value", 7.0)],
)
def test_gpt_oss_activation_goes_to_megatron_and_is_refused_by_the_llama_export(
    field, value, tmp_path
):
    src = _mp("llama_torch_dist_tp1", tmp_path)
    _with_setting(src, field, value)
    export_megatron(src, tmp_path / "meg", ckpt_format="torch_dist")
    assert getattr(read_megatron(tmp_path / "meg").args, field) == value
    import_megatron(tmp_path / "meg", tmp_path / "back")
    assert _settings(tmp_path / "back")[field] == value
    with pytest.raises(ValueError, match=f"model_config {field}={value!r}: llama computes only"):
        export_hf(src, tmp_path / "hf", "llama")


def test_layernorm_1p_is_refused_by_the_hf_export(tmp_path):
    src = _mp("llama_torch_dist_tp1", tmp_path)
    _with_setting(src, "apply_layernorm_1p", True)
    with pytest.raises(ValueError, match="apply_layernorm_1p=True: llama computes only"):
        export_hf(src, tmp_path / "hf", "llama")


def test_megatron_args_with_gpt_oss_activation_import_as_gated():
    from argparse import Namespace

    from mp_ckpt import model_config_from_megatron

    args = Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, quick_geglu=True,
                     glu_linear_offset=1.0, activation_func_clamp_value=7.0)  # fmt: skip
    settings = model_config_from_megatron(args, 128)
    assert (settings["quick_geglu"], settings["glu_linear_offset"]) == (True, 1.0)
    assert settings["activation_func_clamp_value"] == 7.0


def test_deepseek_shaped_exports_are_megatrons_files(tmp_path):
    """The DeepSeek-shaped fixtures (multi-latent attention, DeepSeek's MoE, a multi-token
    prediction module in the legacy one) go to Megatron and back tensor-exact. The
    torch_dist export holds the fixture's model keys and shapes and, beside them, the TE
    spec's names of the latent and pre-MLP norms; the legacy TP2 x EP2 export equals the
    fixture's files tensor for tensor (the MTP module under megatron-core's
    mtp_model_layer). Two names of one norm that differ are refused on import."""
    from torch.distributed.checkpoint import FileSystemReader

    from mp_ckpt.megatron.logical import logical_from_megatron

    model = _round_trip("mla_moe_torch_dist_tp2", "torch_dist", 2, 1, 1, tmp_path / "dist")
    assert model.args.multi_latent_attention and model.args.rope_type == "yarn"
    assert (model.args.rotary_scaling_factor, model.args.mscale_all_dim) == (4.0, 1.0)
    ours = FileSystemReader(tmp_path / "dist" / "meg" / "iter_0000000").read_metadata()
    ours = ours.state_dict_metadata
    theirs = FileSystemReader(ASSETS / "mla_moe_torch_dist_tp2" / "iter_0000002")
    theirs = theirs.read_metadata().state_dict_metadata
    model_keys = {k for k in theirs if not k.startswith(("optimizer.", "rng_state"))}
    assert model_keys <= set(ours)
    te = {f"decoder.layers.{i}.{name}.layer_norm_weight" for i in range(2)
          for name in ("self_attention.linear_q_up_proj", "self_attention.linear_kv_up_proj",
                       "mlp.linear_fc1")}  # fmt: skip
    assert set(ours) - model_keys == te
    for key in model_keys:
        if hasattr(theirs[key], "size"):
            assert tuple(ours[key].size) == tuple(theirs[key].size), key
    alias = "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight"
    model.tensors.add(alias, (8,), torch.float32, lambda: torch.zeros(8))
    with pytest.raises(ValueError, match=r"q_layernorm\.weight and .*linear_q_up_proj\.layer_norm"):
        logical_from_megatron(model)

    case = "mla_moe_mtp_torch_tp2_ep2"
    assert _round_trip(case, "torch", 2, 1, 2, tmp_path / "legacy").args.mtp_num_layers == 1
    _round_trip(case, "torch_dist", 1, 1, 1, tmp_path / "mtp_dist")
    for folder in (ASSETS / case / "iter_0000002").glob("mp_rank_*"):
        ours = safe_load(tmp_path / "legacy" / "meg" / "iter_0000000" / folder.name
                         / "model_optim_rng.pt")["model"]  # fmt: skip
        theirs = safe_load(folder / "model_optim_rng.pt")["model"]
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert value is None or torch.equal(ours[key], value), (folder.name, key)


def test_a_repeated_mtp_module_goes_to_megatron_and_back(tmp_path):
    """--mtp-use-repeated-layer: one module (mtp.layers.0) for mtp_num_layers depths, in
    Megatron's args both ways; the same tensors without the flag are refused both ways,
    naming the modules and the settings."""
    src = _mp("mla_moe_mtp_torch_tp2_ep2", tmp_path)
    _with_setting(src, "mtp_num_layers", 2)
    _with_setting(src, "mtp_use_repeated_layer", True)
    export_megatron(src, tmp_path / "meg", ckpt_format="torch_dist")
    args = read_megatron(tmp_path / "meg").args
    assert (args.mtp_num_layers, args.mtp_use_repeated_layer) == (2, True)
    import_megatron(tmp_path / "meg", tmp_path / "back")
    settings = _settings(tmp_path / "back")
    assert (settings["mtp_num_layers"], settings["mtp_use_repeated_layer"]) == (2, True)
    assert _tensors(tmp_path / "back").keys() == _tensors(src).keys()
    from mp_ckpt.megatron.logical import logical_from_megatron

    model = read_megatron(tmp_path / "meg")
    model.args.mtp_use_repeated_layer = False  # args that disagree with the tensors
    with pytest.raises(ValueError, match=r"modules \[0\], args mtp_num_layers=2"):
        logical_from_megatron(model)
    _with_setting(src, "mtp_use_repeated_layer", False)
    with pytest.raises(ValueError, match="holds 1 multi-token prediction modules, its model_conf"):
        export_megatron(src, tmp_path / "meg2", ckpt_format="torch_dist")
