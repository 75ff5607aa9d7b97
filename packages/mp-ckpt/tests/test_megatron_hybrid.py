"""Megatron-LM's hybrid models (megatron-core's HybridModel: Mamba, attention, MLP and MoE
layers) to mp and back: the fixtures hybrid_torch_dist_tp2 and hybrid_torch_tp2 (one model,
written by megatron-core at TP2 in both formats), and hybrid_mtp_* (the same layers and two
multi-token prediction modules of attention, Mamba and MoE layers), import to the same
tensors from either format, export to torch_dist files that hold the fixture's keys and
shapes and to legacy files equal to megatron-core's, and come back tensor-exact; what the
conversions refuse. (mp's logits from them:
tests/test_megatron_import_logits.py; megatron-core loading the exports:
assets/megatron/load_export.py, README.md.)"""

import argparse
from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, import_megatron
from mp_ckpt.megatron.export_checks import check_exportable
from mp_ckpt.megatron.logical import logical_from_megatron
from mp_ckpt.megatron.read import read_megatron
from mp_ckpt.megatron.settings import model_config_from_megatron
from mp_ckpt.megatron.write import export_megatron

ASSETS = Path(__file__).parent / "assets" / "megatron"
DIST, LEGACY = ASSETS / "hybrid_torch_dist_tp2", ASSETS / "hybrid_torch_tp2"
MTP_DIST, MTP_LEGACY = ASSETS / "hybrid_mtp_torch_dist_tp2", ASSETS / "hybrid_mtp_torch_tp2"
# A fused norm's name in megatron-core's torch_dist files -> its second name in an export
_SECOND_NAMES = {"mixer.in_proj.layer_norm_weight": "norm.weight",
                 "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                 "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}  # fmt: skip


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(root)
    return {k: reader.read(k) for k in reader.keys}


def _model_keys(folder: Path) -> dict[str, tuple | None]:
    from torch.distributed.checkpoint import FileSystemReader

    entries = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {k: tuple(v.size) if hasattr(v, "size") else None for k, v in entries.items()
            if not k.startswith(("optimizer.", "rng_state"))}  # fmt: skip


def test_the_modules_import_from_both_formats_under_megatrons_layer_names():
    dist, settings = logical_from_megatron(read_megatron(MTP_DIST))
    legacy, legacy_settings = logical_from_megatron(read_megatron(MTP_LEGACY))
    assert settings == legacy_settings
    assert (settings["hybrid_layer_pattern"], settings["num_layers"]) == ("M*-E/*ME/*ME", 4)
    assert (settings["mtp_num_layers"], settings["mtp_loss_scaling_factor"]) == (2, 0.1)
    assert dist.keys() == legacy.keys()
    for key, tensor in dist.items():
        assert torch.equal(legacy[key], tensor), key
    layer = "mtp.layers.1.mtp_model_layer.layers.{}."
    for j, name in enumerate(("input_layernorm.weight", "mixer.in_proj.dt.weight",
                              "mlp.experts.linear_fc1.weight")):  # fmt: skip
        assert layer.format(j) + name in dist
    assert {"mtp.layers.1.enorm.weight", "mtp.layers.1.final_layernorm.weight"} <= dist.keys()


def test_both_formats_import_to_one_model_in_mps_names():
    dist, settings = logical_from_megatron(read_megatron(DIST))
    legacy, legacy_settings = logical_from_megatron(read_megatron(LEGACY))
    assert settings == legacy_settings
    assert settings["hybrid_layer_pattern"] == "M*-E" and settings["num_layers"] == 4
    assert (settings["mamba_num_heads"], settings["mamba_head_dim"], settings["mamba_num_groups"],
            settings["mamba_state_dim"]) == (8, 8, 2, 8)  # fmt: skip
    assert settings["moe_layer_freq"] == [1]  # the pattern's E layer is the MoE one
    assert dist.keys() == legacy.keys()
    for key, tensor in dist.items():  # the legacy ranks' [z_r; x_r; B_r; C_r; dt_r] regrouped
        assert torch.equal(legacy[key], tensor), key
    # in_proj's parts by group: [groups, rows of a group, hidden]; conv1d's without its dim of 1
    mixer = "decoder.layers.0.mixer."
    assert dist[mixer + "in_proj.z.weight"].shape == (2, 32, 32)
    assert dist[mixer + "in_proj.dt.weight"].shape == (2, 4, 32)
    assert dist[mixer + "conv1d.B.weight"].shape == (2, 8, 4)
    assert dist[mixer + "conv1d.x.bias"].shape == (2, 32)
    # the Mamba layer's norm, saved by megatron-core's TE spec as in_proj's layer_norm_weight
    assert "decoder.layers.0.norm.weight" in dist
    whole = read_megatron(DIST).tensors
    assert torch.equal(dist["decoder.layers.0.norm.weight"],
                       whole["decoder.layers.0.mixer.in_proj.layer_norm_weight"])  # fmt: skip
    assert torch.equal(dist[mixer + "in_proj.x.weight"].reshape(64, 32),
                       whole[mixer + "in_proj.weight"][64:128])  # fmt: skip
    assert torch.equal(dist["decoder.final_layernorm.weight"], whole["decoder.final_norm.weight"])


@pytest.mark.parametrize(("fixture", "tp"), [(DIST, 1), (DIST, 2), (MTP_DIST, 2)])
def test_torch_dist_export_holds_megatrons_keys_and_comes_back_exact(fixture, tp, tmp_path):
    import_megatron(fixture, tmp_path / "mp")
    out = export_megatron(tmp_path / "mp", tmp_path / "meg", tensor_model_parallel_size=tp)
    ours, theirs = _model_keys(out), _model_keys(fixture / "iter_0000002")
    # layer by layer, in_proj and conv1d as parts; each norm fused into a linear layer also
    # under the local spec's name (the MoE layer's pre-MLP norm also under an MLP's TE name)
    second = {key.removesuffix(te) + name for key in theirs
              for te, name in _SECOND_NAMES.items() if key.endswith("." + te)}  # fmt: skip
    assert "decoder.layers.0.norm.weight" in second
    assert set(ours) - set(theirs) == second
    assert set(theirs) <= set(ours)
    for key, shape in theirs.items():
        assert ours[key] == shape, key
    model = read_megatron(tmp_path / "meg")
    assert model.args.hybrid_layer_pattern == read_megatron(fixture).args.hybrid_layer_pattern
    assert model.args.mamba_num_groups == 2
    assert model.args.tensor_model_parallel_size == tp and model.args.moe_layer_freq == 1
    import_megatron(tmp_path / "meg", tmp_path / "back")
    before, after = _tensors(tmp_path / "mp"), _tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key


SETTINGS = {"num_attention_heads": 4, "num_query_groups": 2, "num_layers": 4, "vocab_size": 128,
            "ffn_hidden_size": 64, "hidden_size": 32, "hybrid_layer_pattern": "M*-E",
            "mamba_num_heads": 8, "mamba_head_dim": 8, "mamba_num_groups": 2,
            "mamba_state_dim": 8}  # fmt: skip


@pytest.mark.parametrize("fixture", [LEGACY, MTP_LEGACY])
def test_the_legacy_export_is_megatrons_files(fixture, legacy_export_is_megatrons):
    """Exported at TP2 in the legacy format, the hybrid fixtures (with MTP modules too)
    equal megatron-core's own files, tensor for tensor and key for key (the local spec's
    names: norm, conv1d_weight, mtp_model_layer.layers.<j>); at TP1 they import back
    exactly."""
    legacy_export_is_megatrons(fixture)


def test_what_the_hybrid_export_refuses():
    check_exportable(SETTINGS, [], 2, 1, "torch_dist")
    check_exportable(SETTINGS, [], 2, 1, "torch")
    check_exportable(SETTINGS | {"hybrid_layer_pattern": "M*-E/*E", "mtp_num_layers": 1},
                     ["mtp.layers.0.enorm.weight"], 1, 1, "torch_dist")  # fmt: skip
    with pytest.raises(ValueError, match="does not divide mamba_num_groups 2"):
        check_exportable(SETTINGS | {"num_query_groups": 4}, [], 4, 1, "torch_dist")
    with pytest.raises(ValueError, match="Mamba mixers but its model_config no hybrid"):
        check_exportable(SETTINGS | {"hybrid_layer_pattern": None},
                         ["decoder.layers.0.mixer.A_log"], 1, 1, "torch_dist")  # fmt: skip


ARGS = {"num_attention_heads": 4, "hidden_size": 32, "num_layers": 4, "norm_epsilon": 1e-5,
        "hybrid_layer_pattern": "M*-E"}  # fmt: skip


def test_what_the_hybrid_import_refuses(tmp_path):
    with pytest.raises(ValueError, match="saved without optimizer state"):
        import_megatron(DIST, tmp_path / "mp", with_optimizer=True)
    with pytest.raises(ValueError, match="saved without optimizer state"):
        import_megatron(MTP_DIST, tmp_path / "mtp", with_optimizer=True)
    settings = model_config_from_megatron(argparse.Namespace(**ARGS), 128)
    assert (settings["mamba_num_heads"], settings["mamba_num_groups"]) == (None, 8)  # defaults
    # --mtp-num-layers without "/" parts: Megatron-LM builds no module
    assert "mtp_num_layers" not in model_config_from_megatron(
        argparse.Namespace(**ARGS, mtp_num_layers=1), 128
    )
    older = argparse.Namespace(**(ARGS | {"hybrid_layer_pattern": None,
                                          "hybrid_override_pattern": "M*-E"}))  # fmt: skip
    assert model_config_from_megatron(older, 128) == settings
    refusals = [
        ({"hybrid_layer_pattern": None, "is_hybrid_model": True},
         "is_hybrid_model without hybrid_layer_pattern"),
        ({"hybrid_layer_pattern": "M*D-"}, r"mp builds the layers M, G, \*, - and E, not D"),
        ({"hybrid_layer_pattern": "M*-E/*E/*-"}, "modules' parts must be alike"),
        ({"hybrid_layer_pattern": "M*-E/*+"}, r"not \+"),
        ({"norm_epsilon": 1e-6}, "Mamba mixers normalize with 1e-05"),
    ]  # fmt: skip
    for change, message in refusals:
        with pytest.raises(ValueError, match=message):
            model_config_from_megatron(argparse.Namespace(**(ARGS | change)), 128)
    # a pattern without Mamba layers computes no gated norm: any epsilon
    attention_only = ARGS | {"hybrid_layer_pattern": "*-E", "norm_epsilon": 1e-6}
    model_config_from_megatron(argparse.Namespace(**attention_only), 128)
