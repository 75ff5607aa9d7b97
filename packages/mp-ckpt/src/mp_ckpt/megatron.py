"""Megatron-LM training checkpoints -> an mp checkpoint (model weights).

    import_megatron(src, out_root, iteration=None)   an mp checkpoint at iteration 0

megatron_read gives Megatron's tensors whole, under its names and fused
layouts; this file renames them to mp's logical tensors (mp-layers' names) and
unfuses them:

    linear_qkv.weight [groups x (heads/groups + 2) x d, h]
        -> linear_qkv.q [groups, heads/groups, d, h], .k / .v [groups, d, h]
    linear_fc1.weight (SwiGLU) [gate; up] -> linear_fc1.gate, linear_fc1.up
    linear_qkv.layer_norm_weight (TE spec) -> input_layernorm.weight
    linear_fc1.layer_norm_weight (TE spec) -> pre_mlp_layernorm.weight

A mixture-of-experts layer (mlp.router.weight, mlp.router.expert_bias, the shared
expert's linear_fc1 / linear_fc2 / gate_weight keep their names):

    mlp.experts.experts.linear_fc1.weight [E, 2F, h] (torch_dist: the experts stacked
        by global number; the legacy format's mlp.experts.local_experts.<e>.* are
        stacked the same way) -> mlp.experts.linear_fc1.gate / .up [E, F, h]
    mlp.experts.experts.linear_fc2.weight [E, h, F] -> mlp.experts.linear_fc2.weight

The model's settings come from the saved args, under the names mp uses
(common["model_config"], as import-hf writes it); the tokenizer files the run
named (GPT-2 BPE, a local Hugging Face tokenizer) are kept when they are here.
A setting mp does not compute the same way (group-limited routing, input jitter,
several load-balancing losses, ...) is refused with its name and value. With
with_optimizer, megatron_optimizer reads the Adam state, which is renamed and
unfused like the weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from mp_ckpt.convert import write_streaming
from mp_ckpt.layout import checkpoint_dir
from mp_ckpt.megatron_read import _LAYER, MegatronModel, MegatronTensors, read_megatron

__all__ = [
    "import_megatron",
    "logical_from_megatron",
    "model_config_from_megatron",
    "tokenizer_from_megatron",
]

TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_KEPT = {
    "input_layernorm.weight", "input_layernorm.bias", "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias", "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "mlp.router.weight", "mlp.router.expert_bias", "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.gate_weight",
}  # fmt: skip
# A layer's fc1 tensors (a SwiGLU one is [gate; up] on `dim`) -> mp's name for them.
_FC1 = {
    "mlp.linear_fc1.": ("mlp.linear_fc1.", 0),
    "mlp.shared_experts.linear_fc1.": ("mlp.shared_experts.linear_fc1.", 0),
    "mlp.experts.experts.linear_fc1.": ("mlp.experts.linear_fc1.", 1),  # [experts, 2F, h]
}
_EXPERTS_FC2 = "mlp.experts.experts.linear_fc2."
# One expert's tensor: the legacy format's local_experts.<e> (numbered globally by
# megatron_read), or torch_dist's experts.experts.<e> (singleton_local_shards)
_ONE_EXPERT = re.compile(
    r"^(decoder\.layers\.\d+\.mlp\.experts\.)(?:local_experts|experts)\.(\d+)\.(.+)$"
)
_GLOBAL = {
    "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight",
}  # fmt: skip


# Megatron settings that change the computation in ways mp does not implement.
_REFUSED = (
    ("multi_latent_attention", False),
    ("quick_geglu", False),  # gpt-oss's activation: mp computes it, the import not yet
    ("glu_linear_offset", 0.0),
    ("activation_func_clamp_value", None),
    ("rotary_interleaved", False),
    ("apply_residual_connection_post_layernorm", False),
    ("heterogeneous_layers_config_path", None),
    ("mtp_num_layers", None),
)


def _arg(args, name: str, default=None):
    return getattr(args, name, default)


def model_config_from_megatron(args, vocab_size: int, where: str = "args") -> dict:
    """mp's model settings (Megatron's names) from Megatron's saved args; vocab_size is
    the padded vocabulary the embedding holds."""

    def refuse(name: str, supported) -> None:
        value = _arg(args, name, supported)
        if value != supported and value is not None:
            raise ValueError(f"{where}: {name}={value!r}: mp imports only {name}={supported!r}")

    for name, supported in _REFUSED:
        refuse(name, supported)
    heads = args.num_attention_heads
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else None
    normalization = _arg(args, "normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(
            f"{where}: normalization={normalization!r}: mp computes LayerNorm, RMSNorm"
        )
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope", "none"):
        raise ValueError(
            f"{where}: position_embedding_type={position!r}: mp computes learned_absolute, "
            "rope and none"
        )
    if _arg(args, "swiglu"):
        activation = "swiglu"
    elif _arg(args, "squared_relu"):
        activation = "squared_relu"
    else:
        activation = "gelu"
    epsilon = _arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))
    seq_length = _arg(args, "seq_length")
    settings = {
        "num_layers": args.num_layers, "hidden_size": args.hidden_size,
        "num_attention_heads": heads, "num_query_groups": groups or heads,
        "kv_channels": _arg(args, "kv_channels") or args.hidden_size // heads,
        "ffn_hidden_size": _arg(args, "ffn_hidden_size") or 4 * args.hidden_size,
        "normalization": normalization, "activation": activation,
        "openai_gelu": bool(_arg(args, "openai_gelu", False)),
        "layernorm_epsilon": epsilon, "position_embedding_type": position,
        "rotary_base": int(_arg(args, "rotary_base", 10000)),
        "rotary_percent": float(_arg(args, "rotary_percent", 1.0)),
        "rotary_seq_len_interpolation_factor": _arg(args, "rotary_seq_len_interpolation_factor"),
        "use_rope_scaling": bool(_arg(args, "use_rope_scaling", False)),
        "add_bias_linear": bool(_arg(args, "add_bias_linear", True)),
        "add_qkv_bias": bool(_arg(args, "add_qkv_bias", False)),
        "qk_layernorm": bool(_arg(args, "qk_layernorm", False)),
        # the same zero-centered weight in both (Megatron's layernorm_zero_centered_gamma)
        "apply_layernorm_1p": bool(_arg(args, "apply_layernorm_1p", False)),
        "untie_embeddings_and_output_weights": bool(
            _arg(args, "untie_embeddings_and_output_weights", False)),
        "hidden_dropout": _arg(args, "hidden_dropout", 0.1),
        "attention_dropout": _arg(args, "attention_dropout", 0.1),
        "init_method_std": _arg(args, "init_method_std", 0.02),
        "vocab_size": vocab_size,
        "max_position_embeddings": _arg(args, "max_position_embeddings") or seq_length,
    }  # fmt: skip
    if seq_length is not None:
        settings["seq_length"] = seq_length
    if settings["use_rope_scaling"]:
        settings["rope_scaling_factor"] = _arg(args, "rope_scaling_factor", 8.0)
    if _arg(args, "num_experts"):
        settings |= moe_settings_from_megatron(args, settings, where)
    return settings


# Megatron MoE settings that change the computation in ways mp does not implement.
_MOE_REFUSED = (
    ("moe_router_num_groups", None), ("moe_router_group_topk", None),
    ("moe_input_jitter_eps", None), ("moe_apply_probs_on_input", False),
    ("moe_latent_size", None), ("moe_router_force_load_balancing", False),
    ("moe_use_legacy_grouped_gemm", False),
)  # fmt: skip
# Copied as they are (mp's TransformerConfig has Megatron's names and meanings).
_MOE_COPIED = {
    "moe_router_topk": 2, "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None,
    "moe_z_loss_coeff": None, "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3, "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False, "moe_token_drop_policy": "probs",
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
    "moe_grouped_gemm": False, "moe_router_dtype": None,
}  # fmt: skip


def moe_settings_from_megatron(args, settings: dict, where: str) -> dict:
    """mp's mixture-of-experts settings from Megatron's saved args."""
    for name, supported in _MOE_REFUSED:
        value = _arg(args, name, supported)
        if value not in (supported, None, False):
            raise ValueError(f"{where}: {name}={value!r}: mp imports only {name}={supported!r}")
    out = {
        "num_moe_experts": int(args.num_experts),
        "moe_ffn_hidden_size": _arg(args, "moe_ffn_hidden_size") or settings["ffn_hidden_size"],
    }
    out |= {name: _arg(args, name, default) for name, default in _MOE_COPIED.items()}
    for name, default in _MOE_COPIED.items():
        if out[name] is None:
            out[name] = default
    balancing = _arg(args, "moe_router_load_balancing_type", "aux_loss")
    coeff = _arg(args, "moe_aux_loss_coeff", 0.0)
    if isinstance(balancing, list):  # one entry per loss: mp computes one
        if len(balancing) != 1:
            raise ValueError(f"{where}: moe_router_load_balancing_type={balancing!r}: mp "
                             "computes one load-balancing loss")  # fmt: skip
        balancing, coeff = balancing[0], coeff[0] if isinstance(coeff, list) else coeff
    if balancing not in ("aux_loss", "seq_aux_loss", "none"):
        raise ValueError(f"{where}: moe_router_load_balancing_type={balancing!r}: mp computes "
                         "aux_loss, seq_aux_loss and none")  # fmt: skip
    out["moe_router_load_balancing_type"] = balancing
    out["moe_aux_loss_coeff"] = float(coeff or 0.0)
    dispatcher = _arg(args, "moe_token_dispatcher_type", "allgather")
    # flex is all-to-all through another communication library: the same tokens move
    out["moe_token_dispatcher_type"] = "alltoall" if dispatcher == "flex" else dispatcher
    freq = _arg(args, "moe_layer_freq", 1)
    layers = settings["num_layers"]
    if isinstance(freq, int):
        freq = [1 if i % freq == 0 else 0 for i in range(layers)]
    if len(freq) != layers:
        raise ValueError(f"{where}: moe_layer_freq={freq!r}: {len(freq)} entries for "
                         f"{layers} layers")  # fmt: skip
    out["moe_layer_freq"] = [int(x) for x in freq]
    return out


def logical_from_megatron(model: MegatronModel) -> tuple[dict[str, torch.Tensor], dict]:
    """(mp's logical tensors, mp's model settings) of a Megatron checkpoint read whole."""
    plan, settings = logical_plan(model)
    return {key: produce() for key, (_, _, produce) in plan.items()}, settings


def _shape(tensors, key: str) -> tuple[int, ...]:
    return tensors.shape(key) if isinstance(tensors, MegatronTensors) else tuple(tensors[key].shape)


def _dtype(tensors, key: str) -> torch.dtype:
    return tensors.dtype(key) if isinstance(tensors, MegatronTensors) else tensors[key].dtype


def logical_plan(model: MegatronModel) -> tuple[dict[str, tuple], dict]:
    """({mp's logical key: (shape, dtype, produce)}, mp's model settings): produce() reads
    the one Megatron tensor the logical tensor comes from and cuts it, so that the tensors
    can be made (and written) one at a time."""
    where = str(model.directory)
    tensors = stack_experts(model.tensors, where)
    if "embedding.word_embeddings.weight" not in tensors:
        raise KeyError(f"{where}: no embedding.word_embeddings.weight")
    vocab_size = _shape(tensors, "embedding.word_embeddings.weight")[0]
    settings = model_config_from_megatron(model.args, vocab_size, f"{where} args")
    heads, groups = settings["num_attention_heads"], settings["num_query_groups"]
    d, per_group = settings["kv_channels"], heads // groups
    plan: dict[str, tuple] = {}

    def add(name: str, key: str, shape, cut=None) -> None:
        def produce() -> torch.Tensor:
            tensor = tensors[key]
            return tensor if cut is None else cut(tensor).contiguous()

        plan[name] = (tuple(shape), _dtype(tensors, key), produce)

    for key in tensors:
        shape = _shape(tensors, key)
        match = _LAYER.match(key)
        if match is None:
            if key not in _GLOBAL:
                raise ValueError(f"{where}: {key}: no place for this tensor in mp's GPTModel")
            if key == "output_layer.weight" and not settings["untie_embeddings_and_output_weights"]:
                continue  # a tied copy
            add(key, key, shape)
            continue
        prefix, rest = f"decoder.layers.{match.group(1)}.", match.group(2)
        if rest in TE_NORM_NAMES:
            add(prefix + TE_NORM_NAMES[rest], key, shape)
        elif rest in _KEPT:
            add(prefix + rest, key, shape)
        elif rest.startswith("self_attention.linear_qkv."):
            part = rest.rsplit(".", 1)[1]
            tail = tuple(shape[1:])
            expected = groups * (per_group + 2) * d
            if shape[0] != expected:
                raise ValueError(
                    f"{where}: {key} has {shape[0]} rows; {groups} query groups of "
                    f"{per_group} heads (+ k, v) of {d} channels make {expected}"
                )
            qkv = prefix + "self_attention.linear_qkv."
            fused = (groups, per_group + 2, d, *tail)
            add(
                f"{qkv}q.{part}",
                key,
                (groups, per_group, d, *tail),
                lambda t, f=fused, n=per_group: t.reshape(f)[:, :n],
            )
            add(
                f"{qkv}k.{part}",
                key,
                (groups, d, *tail),
                lambda t, f=fused, n=per_group: t.reshape(f)[:, n],
            )
            add(
                f"{qkv}v.{part}",
                key,
                (groups, d, *tail),
                lambda t, f=fused, n=per_group: t.reshape(f)[:, n + 1],
            )
        elif (fc1 := rest.rsplit(".", 1)[0] + ".") in _FC1:
            part = rest.rsplit(".", 1)[1]
            name, dim = _FC1[fc1]
            if settings["activation"] == "swiglu":
                first, second = list(shape), list(shape)
                first[dim] -= shape[dim] // 2  # torch.chunk's first half
                second[dim] = shape[dim] // 2
                add(f"{prefix}{name}gate.{part}", key, first,
                    lambda t, d=dim: t.chunk(2, dim=d)[0])  # fmt: skip
                add(f"{prefix}{name}up.{part}", key, second,
                    lambda t, d=dim: t.chunk(2, dim=d)[1])  # fmt: skip
            else:
                add(f"{prefix}{name}{part}", key, shape)
        elif rest.startswith(_EXPERTS_FC2):
            add(f"{prefix}mlp.experts.linear_fc2.{rest.rsplit('.', 1)[1]}", key, shape)
        else:
            raise ValueError(f"{where}: {key}: no place for this tensor in mp's GPTModel")
    layers = {int(m.group(1)) for k in plan if (m := _LAYER.match(k))}
    if layers != set(range(settings["num_layers"])):
        raise ValueError(
            f"{where}: the tensors hold layers {sorted(layers)}, args num_layers="
            f"{settings['num_layers']}"
        )
    return plan, settings


def stack_experts(tensors, where: str) -> MegatronTensors:
    """The tensors with each layer's per-expert tensors (legacy local_experts.<e>, or
    torch_dist's experts.experts.<e>) stacked into one [experts, ...] tensor under
    torch_dist's name mlp.experts.experts.<rest>, read expert by expert when looked up."""
    out = MegatronTensors()
    groups: dict[str, dict[int, str]] = {}
    for key in tensors:
        match = _ONE_EXPERT.match(key)
        if match is None:
            out.add(key, _shape(tensors, key), _dtype(tensors, key),
                    lambda k=key: tensors[k])  # fmt: skip
        else:
            name = f"{match.group(1)}experts.{match.group(3)}"
            groups.setdefault(name, {})[int(match.group(2))] = key
    for name, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{where}: {name}: experts {sorted(by_expert)} are not 0..E-1")
        keys = [by_expert[e] for e in range(len(by_expert))]
        shapes = {_shape(tensors, k) for k in keys}
        if len(shapes) != 1:
            raise ValueError(f"{where}: {name}: the experts' shapes differ: {sorted(shapes)}")
        out.add(name, (len(keys), *shapes.pop()), _dtype(tensors, keys[0]),
                lambda ks=keys: torch.stack([tensors[k] for k in ks]))  # fmt: skip
    return out


def tokenizer_from_megatron(args) -> dict | None:
    """common["tokenizer"] (as import-hf keeps it) from the files the Megatron run named:
    GPT2BPETokenizer's vocab_file / merge_file, HuggingFaceTokenizer's local
    tokenizer_model. None when the run used another tokenizer or the files are not here
    (a Megatron checkpoint does not hold its tokenizer)."""
    from mp_ckpt.hf_tokenizer import export_tokenizer

    data = {name: _arg(args, name) for name in
            ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")}  # fmt: skip
    try:
        files, ids = export_tokenizer({"config": {"data": data}})
    except (FileNotFoundError, ValueError):
        return None
    return {"files": files, **ids} if files else None


def import_megatron(
    src: str | os.PathLike,
    out_root: str | os.PathLike,
    *,
    iteration: int | None = None,
    with_optimizer: bool = False,
    progress: bool = False,
) -> Path:
    """Writes an mp checkpoint (iteration 0, model only, as import-hf does) from a
    Megatron-LM training checkpoint (torch_dist or legacy torch, any TP x PP).
    common.pt holds the model's settings (common["model_config"]) and where it came
    from (imported_from, source_iteration). with_optimizer: also the Adam state, the
    scheduler and the training position (megatron_optimizer), at the source iteration,
    as mp's training checkpoints hold them, for a resume. progress: report the tensors
    written on stderr (progress.py; not with_optimizer, which saves them at once)."""
    model = read_megatron(src, iteration)
    common = {"iteration": 0, "model_config": None, "imported_from": str(model.directory),
              "source_iteration": model.iteration, "source_format": model.format}  # fmt: skip
    if with_optimizer:  # the Adam state is read whole, beside the weights
        from mp_ckpt.checkpointer import Checkpointer
        from mp_ckpt.megatron_optimizer import mp_optimizer_state
        from mp_ckpt.sharding import ShardedTensor

        logical, settings = logical_from_megatron(model)
        states, entries = mp_optimizer_state(model, logical)
        tensors = {**{k: t.contiguous() for k, t in logical.items()}, **states}
        pieces = {k: ShardedTensor(k, t, tuple(t.shape), (0,) * t.dim())
                  for k, t in tensors.items()}  # fmt: skip
        common["model_config"] = settings
        common.update(entries)
        _add_tokenizer(common, model.args)
        Checkpointer(out_root).save(common["iteration"], pieces, common=common)
        return checkpoint_dir(out_root, common["iteration"])
    # One tensor at a time: each logical tensor is read (one Megatron tensor, one layer),
    # cut and written before the next is read.
    plan, settings = logical_plan(model)
    common["model_config"] = settings
    _add_tokenizer(common, model.args)
    meta, producers, chunks = {}, {}, []
    for key, (shape, dtype, produce) in plan.items():
        name = f"{key}@{','.join('0' * len(shape))}"
        meta[name] = torch.empty(shape, dtype=dtype, device="meta")
        producers[name] = produce
        chunks.append({"key": key, "storage_key": name,
                       "dtype": str(dtype).removeprefix("torch."), "global_shape": list(shape),
                       "offset": [0] * len(shape), "shape": list(shape),
                       "flattened_range": None})  # fmt: skip
    return write_streaming(out_root, common["iteration"], meta, producers, [chunks], common,
                           None, progress=progress, description="import-megatron")  # fmt: skip


def _add_tokenizer(common: dict, args) -> None:
    tokenizer = tokenizer_from_megatron(args)
    if tokenizer is not None:
        common["tokenizer"] = tokenizer
