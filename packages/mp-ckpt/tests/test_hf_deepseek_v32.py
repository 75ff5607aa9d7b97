"""DeepSeek-V3.2 <-> mp: config.json (as transformers' DeepseekV32Config writes it) read
into settings and written back to the same settings, what mp would compute otherwise
refused by name on import and on export, the indexer's tensors imported under mp's (and
Megatron-LM's) names and shapes and exported back bit for bit, the same weights as
transformers saves them, and the indexer through export-megatron and import-megatron
(tests/test_hf_families.py compares the logits and tokens with transformers')."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mp_ckpt import (
    Checkpointer,
    CheckpointReader,
    ShardedTensor,
    export_hf,
    import_hf,
    import_megatron,
)
from mp_ckpt.families import family, family_of
from mp_ckpt.hf import model_config_from_hf
from mp_ckpt.megatron.order import megatron_param_order
from mp_ckpt.megatron.read import read_megatron
from mp_ckpt.megatron.write import export_megatron

CONFIG = {
    "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"],
    "vocab_size": 32, "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "qk_head_dim": 24, "head_dim": 8, "v_head_dim": 16, "index_n_heads": 4,
    "index_head_dim": 16, "index_topk": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense", "sparse"],
    "layer_types": ["indexed_attention", "indexed_attention"], "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip
SHAPES = {"vocab": 32, "hidden": 64, "layers": 2, "heads": 4, "groups": 4, "head_dim": 16,
          "tied": False, "ffn": 80, "experts": 4, "expert_ffn": 16, "shared_ffn": 16,
          "sparse": [0, 1]}  # fmt: skip
INDEXER = "self_attention.core_attention.indexer."
INDEXER_SHAPES = {"linear_wq_b.weight": (64, 32), "linear_wk.weight": (16, 64),
                  "k_norm.weight": (16,), "k_norm.bias": (16,),
                  "linear_weights_proj.weight": (4, 64)}  # fmt: skip
"""mp's indexer tensors of CONFIG: wq_b [index_n_heads x index_head_dim, q_lora_rank],
wk [index_head_dim, hidden], k_norm [index_head_dim], weights_proj [index_n_heads, hidden]."""


def hf_state() -> dict[str, torch.Tensor]:
    """Random weights of CONFIG under DeepSeek's names (experts one by one), the shapes
    written out: layer 0 a dense MLP, layer 1 experts."""
    h, q, r, n, dn, dr, dv, ffn, e, f = 64, 32, 16, 4, 16, 8, 16, 80, 4, 16
    shapes = {"model.embed_tokens.weight": (32, h), "lm_head.weight": (32, h),
              "model.norm.weight": (h,)}  # fmt: skip
    for i in range(2):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (h,),
            layer + "post_attention_layernorm.weight": (h,),
            layer + "self_attn.q_a_proj.weight": (q, h),
            layer + "self_attn.q_a_layernorm.weight": (q,),
            layer + "self_attn.q_b_proj.weight": (n * (dn + dr), q),
            layer + "self_attn.kv_a_proj_with_mqa.weight": (r + dr, h),
            layer + "self_attn.kv_a_layernorm.weight": (r,),
            layer + "self_attn.kv_b_proj.weight": (n * (dn + dv), r),
            layer + "self_attn.o_proj.weight": (h, n * dv),
            layer + "self_attn.indexer.wq_b.weight": (4 * 16, q),
            layer + "self_attn.indexer.wk.weight": (16, h),
            layer + "self_attn.indexer.k_norm.weight": (16,),
            layer + "self_attn.indexer.k_norm.bias": (16,),
            layer + "self_attn.indexer.weights_proj.weight": (4, h),
        }  # fmt: skip
    dense = "model.layers.0.mlp."
    shapes |= {dense + "gate_proj.weight": (ffn, h), dense + "up_proj.weight": (ffn, h),
               dense + "down_proj.weight": (h, ffn)}  # fmt: skip
    moe = "model.layers.1.mlp."
    shapes |= {moe + "gate.weight": (e, h), moe + "gate.e_score_correction_bias": (e,)}
    for expert in [f"experts.{j}." for j in range(e)] + ["shared_experts."]:
        shapes |= {moe + expert + "gate_proj.weight": (f, h),
                   moe + expert + "up_proj.weight": (f, h),
                   moe + expert + "down_proj.weight": (h, f)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def hf_folder(folder, config=CONFIG, state=None):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state or hf_state(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_settings_of_deepseek_v32_and_back():
    settings = model_config_from_hf(CONFIG)
    assert family_of(settings) == "deepseek_v32"
    assert settings["multi_latent_attention"] and settings["q_lora_rank"] == 32
    assert {k: v for k, v in settings.items() if k.startswith(("dsa_", "experimental_"))} == {
        "experimental_attention_variant": "dsa", "dsa_indexer_n_heads": 4,
        "dsa_indexer_head_dim": 16, "dsa_indexer_topk": 4, "dsa_indexer_k_norm_epsilon": 1e-6,
        "dsa_indexer_rope_interleaved": False, "dsa_indexer_scoring_relu": True,
        "dsa_indexer_rotate_activation": True, "dsa_indexer_topk_freq": 1,
    }  # fmt: skip
    assert settings["moe_layer_freq"] == [0, 1]
    assert settings["moe_router_score_function"] == "sigmoid"
    fam = family("deepseek_v32")
    config = fam.config(settings, SHAPES, {}, "float32")
    assert (config["model_type"], config["architectures"]) == (
        "deepseek_v32", ["DeepseekV32ForCausalLM"])  # fmt: skip
    assert (config["index_n_heads"], config["index_head_dim"], config["index_topk"]) == (4, 16, 4)
    # DeepseekV32Config has neither; num_nextn_predict_layers only with MTP layers
    assert not {"rope_interleave", "pretraining_tp", "num_nextn_predict_layers"} & set(config)
    assert fam.settings(config) == settings
    with_mtp = fam.config(settings | {"mtp_num_layers": 1}, SHAPES, {}, "float32")
    assert with_mtp["num_nextn_predict_layers"] == 1
    # DeepSeek's own form: no mlp_layer_types, rope_interleave (not read); an index_head_dim
    # that mp's Hadamard rotation does not fit: computed without it, as transformers does
    deepseek = {k: v for k, v in CONFIG.items() if k not in ("mlp_layer_types", "layer_types")}
    assert model_config_from_hf(deepseek | {"rope_interleave": True}) == settings
    wide = model_config_from_hf(CONFIG | {"index_head_dim": 24})
    assert (wide["dsa_indexer_head_dim"], wide["dsa_indexer_rotate_activation"]) == (24, False)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q_lora_rank": None}, r"q_lora_rank=None: transformers' DeepseekV32 always has"),
        ({"layer_types": ["indexed_attention", "full_attention"]},
         r"layer_types=.*sparse attention \('indexed_attention'\) in every layer"),
        ({"mlp_layer_types": ["sparse", "dense"]}, r"mlp_layer_types=\['sparse', 'dense'\]"),
        ({"mlp_layer_types": ["dense", "dense"]}, r"dense ones first, then expert layers"),
        ({"first_k_dense_replace": 0}, r"\(first 1 dense\) and first_k_dense_replace=0 disagree"),
        ({"index_head_dim": 4}, r"index_head_dim=4: the indexer rotates its first "
                                r"qk_rope_head_dim=8"),
        ({"index_topk": 0}, r"index_topk=0: expected a positive integer"),
        ({"scoring_func": "softmax"}, r"scoring_func='softmax': mp computes only"),
    ],
)  # fmt: skip
def test_what_mp_computes_otherwise_is_refused_on_import(changes, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(CONFIG | changes)


@pytest.mark.parametrize(
    ("model_type", "changes", "message"),
    [
        ("deepseek_v32", {"dsa_indexer_scoring_relu": False},
         r"dsa_indexer_scoring_relu=False: deepseek_v32 computes only "
         r"dsa_indexer_scoring_relu=True"),
        ("deepseek_v32", {"dsa_indexer_rope_interleaved": True},
         r"dsa_indexer_rope_interleaved=True: deepseek_v32 computes only"),
        ("deepseek_v32", {"dsa_indexer_topk_freq": 2}, r"dsa_indexer_topk_freq=2: deepseek_v32"),
        ("deepseek_v32", {"dsa_indexer_k_norm_epsilon": 1e-5},
         r"dsa_indexer_k_norm_epsilon=1e-05: transformers' DeepseekV32 indexer"),
        # unset: layernorm_epsilon's (megatron-core's rule)
        ("deepseek_v32", {"dsa_indexer_k_norm_epsilon": None, "layernorm_epsilon": 1e-5},
         r"dsa_indexer_k_norm_epsilon=None \(layernorm_epsilon=1e-05\): transformers'"),
        ("deepseek_v32", {"dsa_indexer_topk": None}, r"dsa_indexer_topk=None: the deepseek_v32 "
                                                     r"export writes it as index_topk"),
        ("deepseek_v32", {"experimental_attention_variant": None},
         r"experimental_attention_variant=None: deepseek_v32 computes only"),
        ("deepseek_v32", {"q_lora_rank": None}, r"q_lora_rank=None: transformers' DeepseekV32"),
        ("deepseek_v3", {}, r"experimental_attention_variant='dsa': deepseek_v3 computes only "
                            r"experimental_attention_variant=None"),
        ("deepseek_v2", {}, r"experimental_attention_variant='dsa': deepseek_v2 computes only"),
    ],
)  # fmt: skip
def test_what_deepseek_v32_computes_otherwise_is_refused_on_export(model_type, changes, message):
    settings = model_config_from_hf(CONFIG) | changes
    with pytest.raises(ValueError, match=message):
        family(model_type).config(settings, SHAPES, {}, "float32")


def test_the_indexer_imports_under_megatrons_names_and_exports_back_exactly(tmp_path):
    """import-hf places each layer's indexer under self_attention.core_attention.indexer.
    (Megatron-LM's names) with its Hugging Face shape; export-hf (the family recorded)
    gives back config.json's settings and every tensor bit for bit; a checkpoint whose
    settings forgot the indexer's widths exports them from its tensors."""
    state = hf_state()
    import_hf(hf_folder(tmp_path / "hf"), tmp_path / "ckpt")
    reader = CheckpointReader(tmp_path / "ckpt")
    indexer = {k: reader.shape(k) for k in reader.keys if ".indexer." in k}
    assert indexer == {f"decoder.layers.{i}.{INDEXER}{name}": shape
                       for i in range(2) for name, shape in INDEXER_SHAPES.items()}  # fmt: skip
    wq_b = reader.read(f"decoder.layers.1.{INDEXER}linear_wq_b.weight")
    assert torch.equal(wq_b, state["model.layers.1.self_attn.indexer.wq_b.weight"])

    export_hf(tmp_path / "ckpt", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32"
    assert model_config_from_hf(config) == model_config_from_hf(CONFIG)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name

    # as training saves it: no family, the settings without the widths the tensors show
    shown = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "experimental_attention_variant",
             "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim")  # fmt: skip
    settings = {k: v for k, v in model_config_from_hf(CONFIG).items() if k not in shown}
    pieces = {k: ShardedTensor(k, reader.read(k), reader.shape(k), (0,) * len(reader.shape(k)))
              for k in reader.keys}  # fmt: skip
    Checkpointer(tmp_path / "trained").save(0, pieces, common={"model_config": settings})
    export_hf(tmp_path / "trained", tmp_path / "trained_out")
    config = json.loads((tmp_path / "trained_out" / "config.json").read_text())
    assert model_config_from_hf(config) == model_config_from_hf(CONFIG)


def test_a_multi_token_prediction_layer_brings_its_indexer(tmp_path):
    """DeepSeek's multi-token prediction layer (model.layers.{L}, DeepSeek-V3's) holds an
    indexer too: mp's mtp.layers.0.transformer_layer...indexer.*, exported back."""
    state = hf_state()
    state |= {
        name.replace("model.layers.1.", "model.layers.2."): tensor.clone()
        for name, tensor in state.items()
        if name.startswith("model.layers.1.")
    }
    gen = torch.Generator().manual_seed(1)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        state[f"model.layers.2.{name}.weight"] = torch.randn(64, generator=gen)
    state["model.layers.2.eh_proj.weight"] = torch.randn(64, 128, generator=gen)
    state["model.layers.2.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.2.shared_head.head.weight"] = state["lm_head.weight"].clone()
    config = CONFIG | {"num_nextn_predict_layers": 1}
    import_hf(hf_folder(tmp_path / "hf", config, state), tmp_path / "ckpt")
    reader = CheckpointReader(tmp_path / "ckpt")
    layer = "mtp.layers.0.transformer_layer."
    assert {k: reader.shape(k) for k in reader.keys if k.startswith(layer + INDEXER)} == {
        layer + INDEXER + name: shape for name, shape in INDEXER_SHAPES.items()}  # fmt: skip
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name


def test_transformers_saves_the_names_and_shapes_these_tests_write(tmp_path):
    """transformers' DeepseekV32ForCausalLM of CONFIG, saved, imports to the same mp names
    and shapes as hf_state's weights, and exports back bit for bit (its config.json too)."""
    transformers = pytest.importorskip("transformers")
    config = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")}
    hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(
        **config, scoring_func="sigmoid", topk_method="noaux_tc"))  # fmt: skip
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    import_hf(hf_folder(tmp_path / "ours"), tmp_path / "ours_ckpt")
    theirs, ours = CheckpointReader(tmp_path / "ckpt"), CheckpointReader(tmp_path / "ours_ckpt")
    assert {k: theirs.shape(k) for k in theirs.keys} == {k: ours.shape(k) for k in ours.keys}

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


def test_the_indexer_goes_to_megatron_and_back(tmp_path):
    """export-megatron writes the indexer under Megatron's names, whole (torch_dist at
    TP2: one tensor of the Hugging Face shape per layer), and the --dsa-* args;
    import-megatron gives back every tensor and the indexer's settings. The legacy files
    are written at TP1 (megatron-core builds the indexer with Transformer Engine's spec
    alone) and refused at TP2. Megatron's parameter order puts the indexer first in its
    attention (its core attention's)."""
    from torch.distributed.checkpoint import FileSystemReader

    import_hf(hf_folder(tmp_path / "hf"), tmp_path / "ckpt")
    settings = model_config_from_hf(CONFIG)
    reader = CheckpointReader(tmp_path / "ckpt")
    before = {k: reader.read(k) for k in reader.keys}
    for fmt, tp in (("torch_dist", 2), ("torch", 1)):
        out = tmp_path / f"meg_{fmt}"
        export_megatron(tmp_path / "ckpt", out, ckpt_format=fmt, tensor_model_parallel_size=tp)
        args = read_megatron(out).args
        assert (args.experimental_attention_variant, args.dsa_indexer_n_heads,
                args.dsa_indexer_head_dim, args.dsa_indexer_topk) == ("dsa", 4, 16, 4)  # fmt: skip
        import_megatron(out, tmp_path / f"back_{fmt}")
        back = CheckpointReader(tmp_path / f"back_{fmt}")
        assert set(back.keys) == set(before)
        for key, tensor in before.items():
            assert torch.equal(back.read(key), tensor), (fmt, key)
        common = torch.load(back.directory / "common.pt", weights_only=False)["model_config"]
        assert family_of(common) == "deepseek_v32"
        for name, value in settings.items():
            if name.startswith("dsa_"):
                assert common[name] == value, name
    metadata = FileSystemReader(tmp_path / "meg_torch_dist" / "iter_0000000").read_metadata()
    saved = metadata.state_dict_metadata
    for name, shape in INDEXER_SHAPES.items():
        assert tuple(saved[f"decoder.layers.1.{INDEXER}{name}"].size) == shape, name
    with pytest.raises(ValueError, match=r"--ckpt-format torch at --tensor-model-parallel-size 2 "
                                         r"with experimental_attention_variant 'dsa'"):  # fmt: skip
        export_megatron(tmp_path / "ckpt", tmp_path / "legacy_tp2", ckpt_format="torch",
                        tensor_model_parallel_size=2)  # fmt: skip

    layer = [f"decoder.layers.0.{name}" for name in (
        "self_attention.linear_proj.weight", f"{INDEXER}linear_weights_proj.weight",
        "input_layernorm.weight", f"{INDEXER}k_norm.bias", f"{INDEXER}linear_wk.weight",
        "self_attention.linear_q_down_proj.weight", f"{INDEXER}k_norm.weight",
        f"{INDEXER}linear_wq_b.weight")]  # fmt: skip
    assert [name.split(".", 3)[3] for name in megatron_param_order(layer)] == [
        "input_layernorm.weight", f"{INDEXER}linear_wq_b.weight", f"{INDEXER}linear_wk.weight",
        f"{INDEXER}k_norm.weight", f"{INDEXER}k_norm.bias",
        f"{INDEXER}linear_weights_proj.weight", "self_attention.linear_proj.weight",
        "self_attention.linear_q_down_proj.weight",
    ]  # fmt: skip
