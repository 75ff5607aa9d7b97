"""The family tables without transformers: each names every parameter once, the registry
lists every family file, family_of finds the family a model's settings describe, and
import refuses a tensor its family has no place for. The Megatron conversion reads the
same tables (but for multi-latent attention's, which it refuses): a rule added to a family
is written to Megatron and read back."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from mp_ckpt import families
from mp_ckpt.families import ARCHITECTURES, REFUSED, family, family_of
from mp_ckpt.families.megatron_view import megatron_name, megatron_view, split_name
from mp_ckpt.families.moe import is_moe_layer
from mp_ckpt.families.table import Dims, Rule
from mp_ckpt.hf import logical_from_hf, model_config_from_hf
from mp_ckpt.megatron.logical import logical_plan
from mp_ckpt.megatron.read import MegatronModel
from mp_ckpt.megatron.settings import model_config_from_megatron
from mp_ckpt.megatron.write import megatron_args, megatron_from_logical

FOLDER = Path(__file__).resolve().parents[1] / "src" / "mp_ckpt" / "families"
LLAMA_STYLE = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 32}  # fmt: skip
MLA = {**LLAMA_STYLE, "num_key_value_heads": 4, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
       "qk_rope_head_dim": 2, "v_head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 8, "n_shared_experts": 1, "first_k_dense_replace": 1}  # fmt: skip
GRANITE_SCALES = {"embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
                  "residual_multiplier": 0.22, "logits_scaling": 8.0}  # fmt: skip
QWEN3_5 = {"num_hidden_layers": 4, "head_dim": 4, "linear_key_head_dim": 4,
           "linear_value_head_dim": 4, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4}  # fmt: skip
CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 4, "vocab_size": 32,
             "n_positions": 8},
    "llama": {"model_type": "llama", **LLAMA_STYLE},
    "mistral": {"model_type": "mistral", **LLAMA_STYLE, "sliding_window": 4},
    "qwen2": {"model_type": "qwen2", **LLAMA_STYLE},
    "qwen3": {"model_type": "qwen3", **LLAMA_STYLE, "head_dim": 8},
    "nemotron": {"model_type": "nemotron", **LLAMA_STYLE},
    "mixtral": {"model_type": "mixtral", **LLAMA_STYLE, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", **LLAMA_STYLE, "num_experts": 4,
                  "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8,
                  "num_experts_per_tok": 2},
    "gpt_oss": {"model_type": "gpt_oss", **LLAMA_STYLE, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 4, "head_dim": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "qwen3_moe": {"model_type": "qwen3_moe", **LLAMA_STYLE, "num_experts": 4,
                  "moe_intermediate_size": 8, "num_experts_per_tok": 2},
    "deepseek_v2": {"model_type": "deepseek_v2", **MLA, "q_lora_rank": None},
    "deepseek_v3": {"model_type": "deepseek_v3", **MLA, "q_lora_rank": 8, "n_group": 1,
                    "topk_group": 1},
    "deepseek_v32": {"model_type": "deepseek_v32", **MLA, "q_lora_rank": 8, "n_group": 1,
                     "topk_group": 1, "index_n_heads": 2, "index_head_dim": 4,
                     "index_topk": 4},
    "glm4_moe_lite": {"model_type": "glm4_moe_lite", **MLA, "q_lora_rank": 8, "n_group": 1,
                      "topk_group": 1},
    "glm_moe_dsa": {"model_type": "glm_moe_dsa", **MLA, "q_lora_rank": 8, "n_group": 1,
                    "topk_group": 1, "index_n_heads": 2, "index_head_dim": 4,
                    "index_topk": 4, "rms_norm_eps": 1e-6},
    "glm4_moe": {"model_type": "glm4_moe", **LLAMA_STYLE, "n_routed_experts": 4,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 8, "n_shared_experts": 1,
                 "first_k_dense_replace": 1, "attention_bias": True, "use_qk_norm": True},
    "smollm3": {"model_type": "smollm3", **LLAMA_STYLE, "num_hidden_layers": 4},
    "phi3": {"model_type": "phi3", **LLAMA_STYLE},
    "seed_oss": {"model_type": "seed_oss", **LLAMA_STYLE, "head_dim": 8},
    "ernie4_5": {"model_type": "ernie4_5", **LLAMA_STYLE, "head_dim": 4},
    "olmo2": {"model_type": "olmo2", **LLAMA_STYLE},
    "olmo3": {"model_type": "olmo3", **LLAMA_STYLE, "sliding_window": 4,
              "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_text": {"model_type": "gemma3_text", **LLAMA_STYLE, "head_dim": 8,
                    "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "minimax_m2": {"model_type": "minimax_m2", **LLAMA_STYLE, "head_dim": 8, "rotary_dim": 4,
                   "num_local_experts": 4, "num_experts_per_tok": 2},
    "glm4": {"model_type": "glm4", **LLAMA_STYLE},
    "granite": {"model_type": "granite", **LLAMA_STYLE, "embedding_multiplier": 12.0,
                "attention_multiplier": 0.0078125, "residual_multiplier": 0.22,
                "logits_scaling": 8.0},
    "granitemoe": {"model_type": "granitemoe", **LLAMA_STYLE, **GRANITE_SCALES,
                   "num_local_experts": 4, "num_experts_per_tok": 2},
    "granitemoeshared": {"model_type": "granitemoeshared", **LLAMA_STYLE, **GRANITE_SCALES,
                         "num_local_experts": 4, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 8},
    "granitemoehybrid": {"model_type": "granitemoehybrid", **LLAMA_STYLE, **GRANITE_SCALES,
                         "num_local_experts": 4, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 8, "mamba_n_heads": 4,
                         "mamba_n_groups": 2, "mamba_d_state": 4,
                         "layer_types": ["mamba", "attention"]},
    "bamba": {"model_type": "bamba", **LLAMA_STYLE, "mamba_n_heads": 4, "mamba_n_groups": 2,
              "mamba_d_state": 4, "attn_layer_indices": [1]},
    "gemma": {"model_type": "gemma", **LLAMA_STYLE, "head_dim": 8},
    "ministral3": {"model_type": "ministral3", **LLAMA_STYLE, "head_dim": 8,
                   "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                       "original_max_position_embeddings": 16,
                                       "llama_4_scaling_beta": 0.1}},
    "qwen3_5_text": {"model_type": "qwen3_5_text", **LLAMA_STYLE, **QWEN3_5},
    "qwen3_5_moe_text": {"model_type": "qwen3_5_moe_text", **LLAMA_STYLE, **QWEN3_5,
                         "num_experts": 4, "moe_intermediate_size": 8,
                         "shared_expert_intermediate_size": 8, "num_experts_per_tok": 2},
    "flex_olmo": {"model_type": "flex_olmo", **LLAMA_STYLE, "num_experts": 4,
                  "num_experts_per_tok": 2},
    "arcee": {"model_type": "arcee", **LLAMA_STYLE, "hidden_act": "relu2", "head_dim": 4},
    "exaone4": {"model_type": "exaone4", **LLAMA_STYLE, "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"]},
    "olmoe": {"model_type": "olmoe", **LLAMA_STYLE, "num_experts": 4,
              "num_experts_per_tok": 2},
    "llama4_text": {"model_type": "llama4_text", **LLAMA_STYLE, "head_dim": 4,
                    "intermediate_size": 8, "intermediate_size_mlp": 24,
                    "num_local_experts": 4},
    "nemotron_h": {"model_type": "nemotron_h", **LLAMA_STYLE, "head_dim": 4,
                   "mamba_num_heads": 4, "mamba_head_dim": 4, "n_groups": 2,
                   "ssm_state_size": 4, "hybrid_override_pattern": "M*-E",
                   "n_routed_experts": 4, "moe_intermediate_size": 8,
                   "moe_shared_expert_intermediate_size": 8},
    "qwen3_next": {"model_type": "qwen3_next", **LLAMA_STYLE, "num_hidden_layers": 4,
                   "head_dim": 4, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
                   "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8,
                   "num_experts_per_tok": 2},
}  # fmt: skip
NOT_MEGATRON = ("olmo2", "olmo3", "olmoe", "flex_olmo", "gemma3_text", "minimax_m2", "glm4",
                "exaone4", "granite", "granitemoe", "granitemoeshared",
                "granitemoehybrid", "gemma", "ministral3")  # fmt: skip
"""Families Megatron-LM cannot compute (norms after the sublayers, queries and keys
normalized over all heads, a gated GELU, Gemma's scales, Granite's multipliers, Ministral
3's query scaling): export-megatron refuses them."""
MEGATRON = [name for name in ARCHITECTURES if not name.startswith("deepseek")
            and name not in ("glm_moe_dsa", "nemotron_h", *NOT_MEGATRON)]  # fmt: skip
"""The families whose tables these tests check against the Megatron-LM conversion (multi-
latent attention's and Mamba-hybrid models' are tested with their megatron-core fixtures)."""
MEGATRON_RUNS = {"llama4_text": {"attention_chunk_size": None, "attn_temperature_floor_scale": None,
                                  "qk_l2_norm_layers": "all"}}  # fmt: skip
"""Where Megatron-LM computes a family otherwise: its Llama 4 has no chunked attention or
NoPE temperature and normalizes every layer's queries and keys."""


def test_the_registry_lists_every_family_file():
    files = {p.stem for p in FOLDER.glob("*.py") if "\nFAMILY = " in p.read_text()}
    assert files == set(ARCHITECTURES) == set(CONFIGS)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_parameter_is_named_once(name):
    rules = family(name).rules
    for side in ("mp", "hf_names"):
        # (a model_copy rule names again, on purpose, the tensor its copy repeats: DeepSeek's
        # MTP copies, Nemotron-H's lm_head of a tied output layer)
        names = [(r.scope, n) for r in rules if not r.model_copy for n in getattr(r, side)]
        assert len(names) == len(set(names)), (name, side)


SETTINGS_ALIKE = {"phi3": "llama", "seed_oss": "qwen2", "glm4_moe_lite": "deepseek_v3",
                  "qwen3_5_moe_text": "qwen3_next"}  # fmt: skip
"""Families whose settings are another's (only their tensors or their training settings
differ: Phi-3's fused q/k/v and gate/up, Seed-OSS's dropout after each sublayer, Qwen3.5
MoE's DeltaNet projections saved apart): without the family an import records, a
checkpoint exports as the other."""


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_family_of_finds_the_family_of_its_settings(name):
    assert family_of(model_config_from_hf(CONFIGS[name])) == SETTINGS_ALIKE.get(name, name)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_config_written_names_the_family(name):
    fam = family(name)
    settings = fam.settings(CONFIGS[name])
    dims = Dims.of(settings)
    shapes = {"vocab": 32, "hidden": dims.hidden, "layers": settings["num_layers"],
              "heads": dims.heads, "groups": dims.groups, "head_dim": dims.head_dim,
              "tied": True, "positions": 8, "ffn": settings.get("ffn_hidden_size"),
              "experts": 4, "expert_ffn": 8, "shared_ffn": 8,
              "sparse": [1] * settings["num_layers"]}  # fmt: skip
    config = fam.config(settings, shapes, {}, "float32")
    assert (config["architectures"], config["model_type"]) == ([fam.architecture], name)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_an_image_and_text_model_is_refused_naming_the_text_model_mp_converts(model_type):
    with pytest.raises(ValueError, match=rf"model_type '{model_type}' is .+'s image-and-text "
                       r"model \(\w+ForConditionalGeneration\): mp converts its text model "
                       r"alone, a checkpoint of .*model_type '\w+'"):  # fmt: skip
        family(model_type)


def test_a_mistral_without_a_window_computes_as_llama():
    settings = model_config_from_hf(CONFIGS["mistral"] | {"sliding_window": None})
    assert family_of(settings) == "llama"


def random_state(config: dict) -> dict[str, torch.Tensor]:
    """Random Hugging Face tensors of the right shapes, made by exporting random logical
    tensors through the family's rules."""
    fam = family(config["model_type"])
    settings = fam.settings(config)
    dims, torch_gen = Dims.of(settings), torch.Generator().manual_seed(0)
    h, d, f, v = dims.hidden, dims.head_dim, settings["ffn_hidden_size"], settings["vocab_size"]
    shapes = {
        "embedding.word_embeddings.weight": (v, h), "output_layer.weight": (v, h),
        "decoder.final_layernorm.weight": (h,), "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.q.weight": (dims.groups, dims.per_group, d, h),
        "self_attention.linear_qkv.k.weight": (dims.groups, d, h),
        "self_attention.linear_qkv.v.weight": (dims.groups, d, h),
        "self_attention.linear_qkv.q.bias": (dims.groups, dims.per_group, d),
        "self_attention.linear_qkv.k.bias": (dims.groups, d),
        "self_attention.linear_qkv.v.bias": (dims.groups, d),
        "self_attention.linear_proj.weight": (h, dims.heads * d),
        "mlp.linear_fc1.gate.weight": (f, h), "mlp.linear_fc1.up.weight": (f, h),
        "mlp.linear_fc2.weight": (h, f),
    }  # fmt: skip
    state = {}
    for rule in fam.rules_for("model", settings) + fam.rules_for("layer", settings) + \
            fam.rules_for("dense", settings):  # fmt: skip
        tensors = [torch.randn(shapes[n], generator=torch_gen) for n in rule.mp]
        for i in (None,) if rule.scope == "model" else range(settings["num_layers"]):
            for n, t in zip(rule.hf_names, rule.export(tensors, dims), strict=True):
                state[n.replace("{i}", str(i))] = t
    return state


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_import_refuses_a_tensor_its_family_has_no_place_for(name):
    config = CONFIGS[name]
    state = random_state(config)
    assert "decoder.layers.1.mlp.linear_fc1.up.weight" in logical_from_hf(state, config)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)  # not a weight
    logical_from_hf(state, config)
    state["model.layers.0.mlp.extra_proj.weight"] = torch.ones(2)
    with pytest.raises(ValueError, match=r"no place for: model\.layers\.0\.mlp\.extra_proj"):
        logical_from_hf(state, config)


# --- the Megatron side reads the same tables --------------------------------------------


def logical_tensors(fam, settings: dict) -> dict[str, torch.Tensor]:
    """Random mp tensors for every parameter the family's rules name under the settings."""
    dims, gen = Dims.of(settings), torch.Generator().manual_seed(0)
    h, d, g, n = dims.hidden, dims.head_dim, dims.groups, dims.per_group
    f, v = settings["ffn_hidden_size"], settings["vocab_size"]
    e, ef = settings.get("num_moe_experts"), settings.get("moe_ffn_hidden_size")
    s = settings.get("moe_shared_expert_intermediate_size")
    fc1, q, kv = {"weight": (f, h), "bias": (f,)}, (g, n, d), (g, d)
    shapes = {
        "embedding.word_embeddings.weight": (v, h), "output_layer.weight": (v, h),
        "embedding.position_embeddings.weight": (settings["max_position_embeddings"], h),
        "self_attention.linear_qkv.q": {"weight": (*q, h), "bias": q},
        "self_attention.linear_qkv.k": {"weight": (*kv, h), "bias": kv},
        "self_attention.linear_qkv.v": {"weight": (*kv, h), "bias": kv},
        "self_attention.linear_proj.weight": (h, g * n * d),
        "self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,),
        "self_attention.core_attention.softmax_offset": (g * n,),
        "mlp.linear_fc1.gate": fc1, "mlp.linear_fc1.up": fc1, "mlp.linear_fc1": fc1,
        "mlp.linear_fc2.weight": (h, f), "mlp.router.weight": (e, h), "mlp.router.bias": (e,),
        "mlp.experts.linear_fc1.gate": {"weight": (e, ef, h), "bias": (e, ef)},
        "mlp.experts.linear_fc1.up": {"weight": (e, ef, h), "bias": (e, ef)},
        "mlp.experts.linear_fc2": {"weight": (e, h, ef), "bias": (e, h)},
        "mlp.shared_experts.linear_fc1.gate.weight": (s, h),
        "mlp.shared_experts.linear_fc1.up.weight": (s, h),
        "mlp.shared_experts.linear_fc2.weight": (h, s), "mlp.shared_experts.gate_weight": (1, h),
    }  # fmt: skip

    def shape(name: str) -> tuple[int, ...]:  # a norm's or a bias's [h] unless listed
        module, part = name.rsplit(".", 1)
        return shapes.get(name) or shapes.get(module, {}).get(part) or (h,)

    out = {}
    for rule in fam.rules_for("model", settings):
        out |= {name: torch.randn(shape(name), generator=gen) for name in rule.mp}
    for i in range(settings["num_layers"]):
        for scope in ("layer", "moe" if is_moe_layer(settings, i) else "dense"):
            for rule in fam.rules_for(scope, settings):
                out |= {f"decoder.layers.{i}.{name}": torch.randn(shape(name), generator=gen)
                        for name in rule.mp}  # fmt: skip
    return out


def megatron_model(settings: dict, tensors: dict) -> MegatronModel:
    dims = Dims.of(settings)  # what export-megatron completes the settings with
    settings = {"num_query_groups": dims.groups, "kv_channels": dims.head_dim} | settings
    args = megatron_args(settings, ckpt_format="torch", tp=1, pp=1, iteration=0)
    return MegatronModel(Path("in-memory"), 0, args, "torch", tensors)


def read_back(settings: dict, tensors: dict) -> dict[str, torch.Tensor]:
    plan, _ = logical_plan(megatron_model(settings, tensors))
    return {key: produce() for key, (_, _, produce) in plan.items()}


def relative(key: str) -> str:
    return re.sub(r"^decoder\.layers\.\d+\.", "", key)


@pytest.mark.parametrize("name", MEGATRON)
def test_the_family_table_names_every_megatron_tensor(name):
    """A Megatron write of the family's model holds only tensors the family's rules name
    (their `megatron` column), and the Megatron read gives back every mp tensor."""
    fam = family(name)
    settings = fam.settings(CONFIGS[name]) | MEGATRON_RUNS.get(name, {})
    logical = logical_tensors(fam, settings)
    megatron = megatron_from_logical(logical, settings)
    named = {megatron_name(rule, n) for rule in fam.rules for n in rule.mp}
    assert {relative(k) for k in megatron} <= named
    back = read_back(settings, megatron)
    assert back.keys() == logical.keys()
    for key, tensor in logical.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("name", NOT_MEGATRON)
def test_megatron_export_refuses_what_megatron_cannot_compute(name):
    fam = family(name)
    settings = fam.settings(CONFIGS[name])
    refused = (
        r"model_config (activation|sublayer_norm|qk_layernorm_scope|"
        r"query_pre_attn_scalar|query_log_scale_beta)=.*Megatron-LM"
    )
    with pytest.raises(ValueError, match=refused):
        megatron_from_logical(logical_tensors(fam, settings), settings)
    windowed = {"window_size": (3, 0), "window_rotary_base": 10000}
    with pytest.raises(ValueError, match=r"model_config window_rotary_base=10000: Megatron-LM"):
        megatron_args(family("mistral").settings(CONFIGS["mistral"]) | windowed,
                      ckpt_format="torch", tp=1, pp=1, iteration=0)  # fmt: skip


EXTRA = Rule(("self_attention.gain.weight",), "model.layers.{i}.self_attn.gain.weight",
             megatron="self_attention.linear_gain")  # fmt: skip


def test_a_rule_added_to_a_family_goes_to_megatron_and_back(monkeypatch):
    fam = family("llama")
    settings = fam.settings(CONFIGS["llama"])
    logical = logical_tensors(fam, settings)
    logical |= {f"decoder.layers.{i}.self_attention.gain.weight": torch.randn(16) for i in (0, 1)}
    with pytest.raises(ValueError, match=r"layers\.0\.self_attention\.gain\.weight: no place"):
        megatron_from_logical(logical, settings)
    extended = dataclasses.replace(fam, rules=(*fam.rules, EXTRA))
    monkeypatch.setattr(families, "family", lambda model_type: extended)
    megatron = megatron_from_logical(logical, settings)
    gain = "decoder.layers.1.self_attention.gain.weight"
    assert torch.equal(
        megatron["decoder.layers.1.self_attention.linear_gain.weight"], logical[gain]
    )
    assert torch.equal(read_back(settings, megatron)[gain], logical[gain])
    monkeypatch.undo()
    with pytest.raises(
        ValueError, match=r"layers\.0\.self_attention\.linear_gain\.weight: no place"
    ):
        read_back(settings, megatron)


def test_the_gpt_model_table_completes_a_family():
    """Megatron's settings may hold what the family's table does not: a plain MLP, biases;
    Transformer Engine's norm names are an alias of the norms."""
    settings = family("llama").settings(CONFIGS["llama"])
    view = megatron_view(settings)
    fc1 = view.named("mlp.linear_fc1.weight", "layer")
    assert (fc1.mp, fc1.fusion) == (
        ("mlp.linear_fc1.gate.weight", "mlp.linear_fc1.up.weight"),
        "glu",
    )
    plain = megatron_view(settings | {"activation": "gelu"}).named("mlp.linear_fc1.weight", "layer")
    assert (plain.mp, plain.fusion) == (("mlp.linear_fc1.weight",), None)
    assert view.named("self_attention.linear_proj.bias", "layer").mp == (
        "self_attention.linear_proj.bias",
    )
    norm = view.named("self_attention.linear_qkv.layer_norm_weight", "layer")
    assert norm.name == "input_layernorm.weight" and norm.mp == ("input_layernorm.weight",)
    assert view.named("mlp.linear_fc1.layer_norm_weight", "model") is None  # a layer's name


def test_multi_latent_attention_picks_a_deepseek_family():
    settings = {"position_embedding_type": "rope", "multi_latent_attention": True}
    assert family_of(settings) == "deepseek_v2"
    assert family_of(settings | {"moe_router_score_function": "sigmoid"}) == "deepseek_v3"
    sparse = settings | {"moe_router_score_function": "sigmoid",
                         "experimental_attention_variant": "dsa"}  # fmt: skip
    assert family_of(sparse) == "deepseek_v32"
    assert family_of(sparse | {"dsa_indexer_rope_interleaved": True}) == "glm_moe_dsa"


def test_the_megatron_view_of_multi_latent_attention_and_multi_token_prediction():
    """The generic table names MLA's tensors (the local spec's names); the TE spec's fused
    latent norms are aliases, and torch_dist writes both names of each norm. A
    multi-token prediction module's tensors are looked up by `split_name`."""
    settings = {"multi_latent_attention": True, "activation": "swiglu"}
    view = megatron_view(settings)
    for name in ("linear_q_proj", "linear_q_down_proj", "linear_kv_up_proj"):
        held = view.named(f"self_attention.{name}.weight", "layer")
        assert held.mp == (f"self_attention.{name}.weight",) and held.fusion is None
    q_norm = view.named("self_attention.linear_q_up_proj.layer_norm_weight", "layer")
    assert q_norm.mp == ("self_attention.q_layernorm.weight",)
    assert q_norm.dist_names == ("self_attention.q_layernorm.weight",
                                 "self_attention.linear_q_up_proj.layer_norm_weight")  # fmt: skip
    kv_norm = view.named("self_attention.linear_kv_up_proj.layer_norm_weight", "layer")
    assert kv_norm.mp == ("self_attention.kv_layernorm.weight",)
    # MLA's TE spec keeps input_layernorm apart: no linear_qkv name
    assert view.named("input_layernorm.weight", "layer").dist_names == ("input_layernorm.weight",)
    assert view.named("pre_mlp_layernorm.weight", "layer").dist_names == (
        "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")  # fmt: skip
    # a multi-token prediction module's own tensors, and its layer's as a decoder layer's
    assert split_name("mtp.layers.1.eh_proj.weight") == ("mtp.layers.1.", "eh_proj.weight", "mtp")
    prefix, rest, where = split_name("mtp.layers.0.transformer_layer.mlp.router.expert_bias")
    assert (prefix, where) == ("mtp.layers.0.transformer_layer.", "layer")
    assert view.named(rest, where).mp == ("mlp.router.expert_bias",)
    assert view.named("enorm.weight", "mtp").mp == ("enorm.weight",)
    assert view.named("enorm.weight", "layer") is None
    # a standard attention's norms keep the one TE name both specs save
    llama = megatron_view(family("llama").settings(CONFIGS["llama"]))
    assert llama.named("input_layernorm.weight", "layer").dist_names == (
        "self_attention.linear_qkv.layer_norm_weight",)  # fmt: skip


def test_the_megatron_import_refuses_other_linear_attention_variants():
    args = megatron_args(family("qwen3_next").settings(CONFIGS["qwen3_next"]),
                         ckpt_format="torch", tp=1, pp=1, iteration=1)  # fmt: skip
    assert args.experimental_attention_variant == "gated_delta_net"
    assert model_config_from_megatron(args, 32)["experimental_attention_variant"] == "gdn"
    args.experimental_attention_variant = "gdn2"
    with pytest.raises(ValueError, match=r"experimental_attention_variant='gdn2': mp imports"):
        model_config_from_megatron(args, 32)


def test_the_megatron_import_takes_what_megatron_core_ignores_and_refuses_what_it_lacks():
    """apply_residual_connection_post_layernorm changes nothing in megatron-core (read
    nowhere): imported as the same model; a heterogeneous layers file is refused."""
    args = megatron_args(family("llama").settings(CONFIGS["llama"]),
                         ckpt_format="torch", tp=1, pp=1, iteration=1)  # fmt: skip
    plain = model_config_from_megatron(args, 32)
    args.apply_residual_connection_post_layernorm = True
    assert model_config_from_megatron(args, 32) == plain
    args.moe_input_jitter_eps = 0.01  # a dense model: MoE settings are not read
    args.heterogeneous_layers_config_path = "layers.json"
    with pytest.raises(ValueError, match=r"heterogeneous_layers_config_path='layers\.json'"):
        model_config_from_megatron(args, 32)
