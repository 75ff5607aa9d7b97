"""GLM-5 <-> mp: config.json read into settings and written back to the same settings, its
indexer layers ("full" or "shared", however config.json gives them) read as Megatron-LM's
dsa_indexer_topk_freq and dsa_indexer_skip_topk_offset and written back as transformers
reads them, what mp would compute otherwise refused by name on import and on export, and
transformers' saved weights imported (the indexer in the full layers alone) and exported
back bit for bit, also through export-megatron and import-megatron
(tests/test_hf_families.py compares the logits and tokens with transformers')."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mp_ckpt import CheckpointReader, export_hf, import_hf, import_megatron
from mp_ckpt.families import family, family_of
from mp_ckpt.families.table import has_dsa_indexer
from mp_ckpt.hf import model_config_from_hf
from mp_ckpt.megatron.write import export_megatron

CONFIG = {
    "model_type": "glm_moe_dsa", "vocab_size": 32, "hidden_size": 64,
    "intermediate_size": 80, "moe_intermediate_size": 16, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}  # fmt: skip
"""Three layers (a dense MLP, then experts). GlmMoeDsaConfig's own rms_norm_eps (1e-5):
test_glm5s_norm_epsilon_leaves_the_latents_at_transformers_1e_6."""
SHARED = {"index_topk_freq": 2, "index_skip_topk_offset": 1}
"""Layers full, shared, full."""
SHAPES = {"vocab": 32, "hidden": 64, "layers": 3, "heads": 4, "groups": 4, "head_dim": 16,
          "tied": False, "ffn": 80, "experts": 4, "expert_ffn": 16, "shared_ffn": 16,
          "sparse": [0, 1, 1]}  # fmt: skip
INDEXER = "self_attention.core_attention.indexer."
ABSENT = object()
"""A key left out."""
INDEXER_SHAPES = {"linear_wq_b.weight": (64, 32), "linear_wk.weight": (16, 64),
                  "k_norm.weight": (16,), "k_norm.bias": (16,),
                  "linear_weights_proj.weight": (4, 64)}  # fmt: skip


def changed(values: dict, changes: dict) -> dict:
    """values with changes over them, those to ABSENT left out."""
    return {k: v for k, v in (values | changes).items() if v is not ABSENT}


def dsa_fields(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k.startswith(("dsa_", "experimental_"))}


def hf_kinds(freq: int, offset: int, layers: int) -> list[str]:
    """GlmMoeDsaConfig's rule: 0-based layer i is full when max(i - offset + 1, 0) % freq is 0."""
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def test_settings_of_glm_moe_dsa_and_back():
    settings = model_config_from_hf(CONFIG)
    assert family_of(settings) == "glm_moe_dsa"
    assert dsa_fields(settings) == {
        "experimental_attention_variant": "dsa", "dsa_indexer_n_heads": 4,
        "dsa_indexer_head_dim": 16, "dsa_indexer_topk": 4, "dsa_indexer_k_norm_epsilon": 1e-6,
        "dsa_indexer_rope_interleaved": True, "dsa_indexer_scoring_relu": True,
        "dsa_indexer_rotate_activation": False, "dsa_indexer_topk_freq": 1,
        "dsa_indexer_skip_topk_offset": 0,
    }  # fmt: skip
    fam = family("glm_moe_dsa")
    config = fam.config(settings, SHAPES, {}, "float32")
    assert (config["model_type"], config["architectures"]) == (
        "glm_moe_dsa", ["GlmMoeDsaForCausalLM"])  # fmt: skip
    assert config["indexer_types"] == ["full"] * 3
    assert not {"index_topk_freq", "index_skip_topk_offset", "rope_interleave"} & set(config)
    assert fam.settings(config) == settings

    shared = model_config_from_hf(CONFIG | SHARED)
    assert shared == settings | {"dsa_indexer_topk_freq": 2, "dsa_indexer_skip_topk_offset": 1}
    config = fam.config(shared, SHAPES, {}, "float32")
    assert config["indexer_types"] == ["full", "shared", "full"]
    assert (config["index_topk_freq"], config["index_skip_topk_offset"]) == (2, 1)
    assert fam.settings(config) == shared
    # Megatron's offset 0 (its default) shares as offset 1 does: written as 1
    megatron = fam.config(shared | {"dsa_indexer_skip_topk_offset": 0}, SHAPES, {}, "float32")
    assert megatron == config


def test_the_indexer_layers_read_as_megatrons_rule():
    """Every indexer_types that some index_topk_freq f and index_skip_topk_offset o >= 1 give
    (up to 8 layers) reads as settings whose layers with an indexer (table.has_dsa_indexer,
    Megatron-LM's rule) are the full ones, whether config.json gives the list, the
    pattern, or f and o; GlmMoeDsaConfig's default offset is 2."""
    for layers in range(1, 9):
        for freq in range(1, 5):
            for offset in range(1, 5):
                kinds = hf_kinds(freq, offset, layers)
                config = CONFIG | {"num_hidden_layers": layers, "first_k_dense_replace": 0}
                pattern = "".join(k[0].upper() for k in kinds)
                schedule = {"index_topk_freq": freq, "index_skip_topk_offset": offset}
                for given in ({"indexer_types": kinds}, {"index_topk_pattern": pattern}, schedule):
                    settings = model_config_from_hf(config | given)
                    held = ["full" if has_dsa_indexer(settings, i) else "shared"
                            for i in range(layers)]  # fmt: skip
                    assert held == kinds, (layers, freq, offset, given)
    config = CONFIG | {"num_hidden_layers": 4, "index_topk_freq": 2}
    assert dsa_fields(model_config_from_hf(config))["dsa_indexer_skip_topk_offset"] == 2


def test_transformers_reads_the_written_keys_as_the_same_layers():
    """transformers derives indexer_types from index_topk_freq and index_skip_topk_offset
    alone, and reads the list first: both keys the export writes give the same layers."""
    transformers = pytest.importorskip("transformers")
    fam = family("glm_moe_dsa")
    for layers, changes in ((3, SHARED), (6, {"index_topk_freq": 3}), (3, {})):
        config = CONFIG | {"num_hidden_layers": layers} | changes
        shapes = SHAPES | {"layers": layers, "sparse": [0] + [1] * (layers - 1)}
        written = fam.config(model_config_from_hf(config), shapes, {}, "float32")
        given = {k: v for k, v in written.items() if k not in ("model_type", "architectures")}
        read = transformers.GlmMoeDsaConfig(**given).indexer_types
        without = {k: v for k, v in given.items() if k != "indexer_types"}
        assert read == transformers.GlmMoeDsaConfig(**without).indexer_types
        assert read == written["indexer_types"]
        assert read == transformers.GlmMoeDsaConfig(**config).indexer_types


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"indexer_types": ["shared", "full", "full"]},
         r"layer 0 is 'shared', with no earlier layer's choice to reuse"),
        ({"index_topk_freq": 2, "index_skip_topk_offset": 0}, r"layer 0 is 'shared'"),
        ({"num_hidden_layers": 5, "indexer_types": ["full", "shared", "full", "full", "shared"]},
         r"indexer_types=\['full', 'shared', 'full', 'full', 'shared'\]: mp shares a choice as "
         r"Megatron-LM does, .* which gives no such pattern"),
        ({"indexer_types": ["full", "shared"]},
         r"indexer_types=\['full', 'shared'\]: expected 'full' or 'shared' for each of the "
         r"num_hidden_layers=3 layers"),
        ({"indexer_types": ["full", "sparse", "full"]}, r"expected 'full' or 'shared'"),
        ({"index_topk_pattern": "FSX"}, r"index_topk_pattern='FSX': expected 'full' or 'shared'"),
        ({"index_skip_topk_offset": -1}, r"index_skip_topk_offset=-1: expected an integer >= 0"),
        (SHARED | {"num_nextn_predict_layers": 2},
         r"num_nextn_predict_layers=2 with shared indexer layers: multi-token prediction "
         r"depth 2 would reuse"),
        ({"q_lora_rank": None}, r"q_lora_rank=None: transformers' GlmMoeDsa always has"),
        ({"layer_types": ["indexed_attention"] * 2 + ["full_attention"]},
         r"GLM-5 has sparse attention \('indexed_attention'\) in every layer"),
        ({"index_head_dim": 4}, r"index_head_dim=4: the indexer rotates its first"),
    ],
)  # fmt: skip
def test_what_mp_computes_otherwise_is_refused_on_import(changes, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(changed(CONFIG, changes))


@pytest.mark.parametrize(
    ("model_type", "changes", "message"),
    [
        ("glm_moe_dsa", {"dsa_indexer_rope_interleaved": False},
         r"dsa_indexer_rope_interleaved=False: transformers' GlmMoeDsa indexer rotates in "
         r"interleaved pairs"),
        ("glm_moe_dsa", {"dsa_indexer_rope_interleaved": ABSENT},  # TransformerConfig's: False
         r"dsa_indexer_rope_interleaved=False"),
        ("glm_moe_dsa", {"dsa_indexer_scoring_relu": False},
         r"dsa_indexer_scoring_relu=False: glm_moe_dsa computes only"),
        ("glm_moe_dsa", {"dsa_indexer_k_norm_epsilon": 1e-5},
         r"dsa_indexer_k_norm_epsilon=1e-05: transformers' GlmMoeDsa indexer"),
        ("glm_moe_dsa", {"dsa_indexer_topk_freq": 0}, r"dsa_indexer_topk_freq=0: expected an "
                                                      r"integer >= 1"),
        ("glm_moe_dsa", {"dsa_indexer_topk_freq": 2, "dsa_indexer_skip_topk_offset": 1,
                         "mtp_num_layers": 2},
         r"dsa_indexer_topk_freq=2 with mtp_num_layers=2: multi-token prediction depth 2"),
        ("glm_moe_dsa", {"experimental_attention_variant": None},
         r"experimental_attention_variant=None: glm_moe_dsa computes only"),
        ("glm_moe_dsa", {"dsa_indexer_topk": None}, r"the glm_moe_dsa export writes it as "
                                                    r"index_topk"),
        ("deepseek_v32", {}, r"dsa_indexer_rope_interleaved=True: deepseek_v32 computes only"),
        ("deepseek_v32", {"dsa_indexer_rope_interleaved": False, "dsa_indexer_topk_freq": 2},
         r"dsa_indexer_topk_freq=2: deepseek_v32 computes only"),
    ],
)  # fmt: skip
def test_what_glm_moe_dsa_computes_otherwise_is_refused_on_export(model_type, changes, message):
    settings = changed(model_config_from_hf(CONFIG), changes)
    with pytest.raises(ValueError, match=message):
        family(model_type).config(settings, SHAPES, {}, "float32")


def test_omitted_keys_read_as_transformers_fills_them():
    """A config.json without the widths (but those every family needs) reads as
    GlmMoeDsaConfig's own, saved, does."""
    transformers = pytest.importorskip("transformers")
    given = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-6}  # fmt: skip
    filled = transformers.GlmMoeDsaConfig(**given).to_dict()
    assert model_config_from_hf({"model_type": "glm_moe_dsa", **given}) == model_config_from_hf(
        filled)  # fmt: skip


@pytest.mark.parametrize("sharing", [{}, SHARED], ids=["full", "shared"])
def test_transformers_weights_import_and_export_back_exactly(tmp_path, sharing):
    """transformers' GlmMoeDsaForCausalLM, saved: import-hf places each full layer's indexer
    under Megatron-LM's names with its Hugging Face shape (none in a shared layer);
    export-hf gives back every tensor bit for bit and the same config; export-megatron
    (torch_dist at TP2, legacy at TP1) and import-megatron give back every tensor and the
    sharing."""
    transformers = pytest.importorskip("transformers")
    config = {k: v for k, v in (CONFIG | sharing).items() if k != "model_type"}
    torch.manual_seed(0)
    transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**config)).save_pretrained(
        tmp_path / "hf")  # fmt: skip
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    reader = CheckpointReader(tmp_path / "ckpt")
    full = [0, 2] if sharing else [0, 1, 2]
    assert {k: reader.shape(k) for k in reader.keys if ".indexer." in k} == {
        f"decoder.layers.{i}.{INDEXER}{name}": shape
        for i in full for name, shape in INDEXER_SHAPES.items()}  # fmt: skip

    export_hf(tmp_path / "ckpt", tmp_path / "out")
    source = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    back = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    saved = transformers.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    for config_dict in (back, saved):
        config_dict.pop("_name_or_path")
    assert back == saved

    before = {k: reader.read(k) for k in reader.keys}
    for fmt, tp in (("torch_dist", 2), ("torch", 1)):
        export_megatron(tmp_path / "ckpt", tmp_path / f"meg_{fmt}", ckpt_format=fmt,
                        tensor_model_parallel_size=tp)  # fmt: skip
        import_megatron(tmp_path / f"meg_{fmt}", tmp_path / f"back_{fmt}")
        megatron = CheckpointReader(tmp_path / f"back_{fmt}")
        assert set(megatron.keys) == set(before)
        for key, tensor in before.items():
            assert torch.equal(megatron.read(key), tensor), (fmt, key)
        common = torch.load(megatron.directory / "common.pt", weights_only=False)["model_config"]
        assert family_of(common) == "glm_moe_dsa"
        settings = model_config_from_hf(CONFIG | sharing)
        for name in ("dsa_indexer_topk_freq", "dsa_indexer_rope_interleaved"):
            assert common[name] == settings[name], (fmt, name)


def test_glm5s_norm_epsilon_leaves_the_latents_at_transformers_1e_6():
    """GLM-5's rms_norm_eps of 1e-5 (its config.json's, and GlmMoeDsaConfig's default)
    becomes layernorm_epsilon; transformers' latent norms keep 1e-6, latent_norm_epsilon;
    the export writes rms_norm_eps back and refuses latents normalized otherwise."""
    settings = model_config_from_hf(CONFIG | {"rms_norm_eps": 1e-5})
    assert settings["layernorm_epsilon"] == 1e-5
    assert settings["latent_norm_epsilon"] == 1e-6
    assert "latent_norm_epsilon" not in model_config_from_hf(CONFIG)
    fam = family("glm_moe_dsa")
    assert fam.config(settings, SHAPES, {}, "float32")["rms_norm_eps"] == 1e-5
    with pytest.raises(ValueError, match=r"latent_norm_epsilon=None \(layernorm_epsilon=1e-05"):
        fam.config(settings | {"latent_norm_epsilon": None}, SHAPES, {}, "float32")


def test_a_multi_token_prediction_layer_after_a_shared_layer_brings_its_indexer(tmp_path):
    """Layers full, full, shared (index_topk_freq 2, offset 2), then GLM-5's multi-token
    prediction layer (model.layers.3): shaped as the last layer, which holds no indexer,
    it chooses its own positions (Megatron numbers it 1), so its indexer is imported
    (mtp.layers.0.transformer_layer...indexer.*) and exported back bit for bit."""
    transformers = pytest.importorskip("transformers")
    sharing = {"index_topk_freq": 2, "index_skip_topk_offset": 2}
    config = {k: v for k, v in (CONFIG | sharing).items() if k != "model_type"}
    torch.manual_seed(0)
    transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**config)).save_pretrained(
        tmp_path / "hf")  # fmt: skip
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    mtp = {n.replace("model.layers.2.", "model.layers.3."): t.clone()
           for n, t in state.items() if n.startswith("model.layers.2.")}  # fmt: skip
    for name, tensor in state.items():  # the indexer the shared layer 2 lacks: layer 1's
        if name.startswith("model.layers.1.self_attn.indexer."):
            mtp[name.replace("model.layers.1.", "model.layers.3.")] = torch.randn(
                tensor.shape, generator=gen)  # fmt: skip
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{name}.weight"] = torch.randn(64, generator=gen)
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(64, 128, generator=gen)
    mtp["model.layers.3.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    mtp["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"].clone()
    state |= mtp
    save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps(written | {"num_nextn_predict_layers": 1}))  # fmt: skip
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    reader = CheckpointReader(tmp_path / "ckpt")
    assert {k for k in reader.keys if ".indexer.linear_wk." in k} == {
        f"decoder.layers.{i}.{INDEXER}linear_wk.weight" for i in (0, 1)} | {
        f"mtp.layers.0.transformer_layer.{INDEXER}linear_wk.weight"}  # fmt: skip
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
