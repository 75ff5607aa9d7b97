"""Megatron-LM's gated DeltaNet layers and gated attention to mp and back: the fixtures
qwen3_next_torch_dist_tp2 and qwen3_next_torch_tp2 (one GPT model written by megatron-core
at TP2 in both formats: a DeltaNet layer with MoE, a gated softmax layer with query/key
norms; qwen3_next_mtp_torch_dist_tp2 with a multi-token prediction module), and
hybrid_gdn_* (a HybridModel "MG*E": Mamba, gated DeltaNet, attention and MoE layers),
import to the same tensors from either format, export to torch_dist files holding the
fixture's keys and shapes and to legacy files equal to megatron-core's, and come back
tensor-exact. (mp's logits from them: tests/test_megatron_import_logits.py; megatron-core
loading the exports: assets/megatron/load_export.py, README.md.)"""

from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, export_hf, import_megatron
from mp_ckpt.megatron.logical import logical_from_megatron
from mp_ckpt.megatron.read import read_megatron
from mp_ckpt.megatron.write import export_megatron

ASSETS = Path(__file__).parent / "assets" / "megatron"
DIST, LEGACY = ASSETS / "qwen3_next_torch_dist_tp2", ASSETS / "qwen3_next_torch_tp2"
HYBRID_DIST, HYBRID_LEGACY = ASSETS / "hybrid_gdn_torch_dist_tp2", ASSETS / "hybrid_gdn_torch_tp2"
MTP_DIST = ASSETS / "qwen3_next_mtp_torch_dist_tp2"  # DIST's model with an MTP module
_IN_PROJ, _QKV = (
    "self_attention.in_proj.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_weight",
)
# A fused norm's name in megatron-core's torch_dist files -> the names an export adds: every
# layer's input norm under both layer kinds' TE names (a load reads the one its layer asks
# for); a hybrid model's norms also under the local spec's names
_MORE_NAMES = {
    DIST: {_IN_PROJ: (_QKV,), _QKV: (_IN_PROJ,)},
    MTP_DIST: {_IN_PROJ: (_QKV,), _QKV: (_IN_PROJ,)},
    HYBRID_DIST: {_IN_PROJ: (_QKV, "input_layernorm.weight"),
                  _QKV: (_IN_PROJ, "input_layernorm.weight"),
                  "mixer.in_proj.layer_norm_weight": ("norm.weight",),
                  "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight",)},
}  # fmt: skip


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(root)
    return {k: reader.read(k) for k in reader.keys}


def _model_keys(folder: Path) -> dict[str, tuple | None]:
    from torch.distributed.checkpoint import FileSystemReader

    entries = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {k: tuple(v.size) if hasattr(v, "size") else None for k, v in entries.items()
            if not k.startswith(("optimizer.", "rng_state"))}  # fmt: skip


@pytest.mark.parametrize(("dist", "legacy"), [(HYBRID_DIST, HYBRID_LEGACY)])
def test_a_hybrid_models_delta_net_layer_imports_from_both_formats(dist, legacy):
    """The hybrid's G layer (layer 1): a DeltaNet and its norm, Megatron's widths."""
    tensors, settings = logical_from_megatron(read_megatron(dist))
    legacy_tensors, legacy_settings = logical_from_megatron(read_megatron(legacy))
    assert settings == legacy_settings and settings["hybrid_layer_pattern"] == "MG*E"
    assert (settings["linear_num_key_heads"], settings["linear_num_value_heads"]) == (2, 4)
    assert "experimental_attention_variant" not in settings
    assert tensors.keys() == legacy_tensors.keys()
    assert all(torch.equal(legacy_tensors[k], t) for k, t in tensors.items())
    layer = "decoder.layers.1."
    assert tensors[layer + "self_attention.in_proj.z.weight"].shape == (2, 16, 32)
    whole = read_megatron(dist).tensors
    assert torch.equal(tensors[layer + "input_layernorm.weight"], whole[layer + _IN_PROJ])


def test_both_formats_import_to_one_model_in_mps_names():
    """The DeltaNet's in_proj and conv1d by key head (torch_dist's parts and the legacy
    ranks' [query_r; key_r; ...] alike), the gate beside the queries, the settings."""
    dist, settings = logical_from_megatron(read_megatron(DIST))
    legacy, legacy_settings = logical_from_megatron(read_megatron(LEGACY))
    assert settings == legacy_settings
    assert (settings["experimental_attention_variant"], settings["linear_attention_freq"],
            settings["attention_output_gate"]) == ("gdn", 2, True)  # fmt: skip
    assert (
        settings["linear_num_key_heads"],
        settings["linear_num_value_heads"],
        settings["linear_key_head_dim"],
        settings["linear_value_head_dim"],
    ) == (2, 4, 8, 8)
    assert dist.keys() == legacy.keys()
    for key, tensor in dist.items():
        assert torch.equal(legacy[key], tensor), key
    gdn, attention = "decoder.layers.0.self_attention.", "decoder.layers.1.self_attention."
    assert dist[gdn + "in_proj.query.weight"].shape == (2, 8, 32)  # [Hk, dk, h]
    assert dist[gdn + "in_proj.z.weight"].shape == (2, 16, 32)  # [Hk, r dv, h]
    assert dist[gdn + "in_proj.alpha.weight"].shape == (2, 2, 32)  # [Hk, r, h]
    assert dist[gdn + "conv1d.value.weight"].shape == (2, 16, 4)
    assert dist[attention + "linear_qkv.gate.weight"].shape == (2, 2, 8, 32)
    whole = read_megatron(DIST).tensors
    assert torch.equal(dist[gdn + "in_proj.value.weight"].reshape(32, 32),
                       whole[gdn + "in_proj.weight"][32:64])  # fmt: skip
    # [q (2 heads), gate (2 heads), k, v] per query group of 8 channels a head
    qkv = whole[attention + "linear_qkv.weight"].reshape(2, 6, 8, 32)
    assert torch.equal(dist[attention + "linear_qkv.gate.weight"], qkv[:, 2:4])
    assert torch.equal(dist["decoder.layers.0.input_layernorm.weight"],
                       whole[gdn + "in_proj.layer_norm_weight"])  # fmt: skip


@pytest.mark.parametrize(("fixture", "tp"),
                         [(DIST, 1), (DIST, 2), (HYBRID_DIST, 2), (MTP_DIST, 2)])  # fmt: skip
def test_torch_dist_export_holds_megatrons_keys_and_comes_back_exact(fixture, tp, tmp_path):
    import_megatron(fixture, tmp_path / "mp")
    out = export_megatron(tmp_path / "mp", tmp_path / "meg", tensor_model_parallel_size=tp)
    ours, theirs = _model_keys(out), _model_keys(fixture / "iter_0000002")
    more = {key.removesuffix(te) + name for key in theirs
            for te, names in _MORE_NAMES[fixture].items() if key.endswith("." + te)
            for name in names}  # fmt: skip
    assert set(ours) - set(theirs) == more
    assert set(theirs) <= set(ours)
    for key, shape in theirs.items():
        assert ours[key] == shape, key
    model = read_megatron(tmp_path / "meg")
    assert model.args.tensor_model_parallel_size == tp
    if fixture in (DIST, MTP_DIST):
        assert model.args.experimental_attention_variant == "gated_delta_net"
        assert model.args.attention_output_gate
    else:  # a hybrid model's G layers: the widths alone
        assert model.args.hybrid_layer_pattern == "MG*E"
        assert model.args.experimental_attention_variant is None
        assert model.args.linear_num_value_heads == 4
    import_megatron(tmp_path / "meg", tmp_path / "back")
    before, after = _tensors(tmp_path / "mp"), _tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key


@pytest.mark.parametrize("fixture", [LEGACY, HYBRID_LEGACY])
def test_the_legacy_export_is_megatrons_files(fixture, legacy_export_is_megatrons):
    """Exported at TP2 in the legacy format, the fixture equals megatron-core's own files,
    tensor for tensor and key for key; at TP1 it imports back exactly."""
    legacy_export_is_megatrons(fixture)


def test_a_hybrid_with_delta_net_layers_has_no_hugging_face_layout(tmp_path):
    """transformers' NemotronH has no G layer: export-hf refuses, naming the pattern and the
    layer kind, before reading any tensor."""
    import_megatron(HYBRID_DIST, tmp_path / "mp")
    with pytest.raises(ValueError, match=r"'MG\*E': nemotron_h has no linear_attention layers"):
        export_hf(tmp_path / "mp", tmp_path / "hf", "nemotron_h")
