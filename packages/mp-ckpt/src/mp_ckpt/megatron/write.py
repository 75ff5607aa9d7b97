"""An mp checkpoint's model -> a Megatron-LM training checkpoint (`--load` reads it).

    export_megatron(src, dst, ckpt_format="torch_dist"|"torch",
                    tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                    expert_model_parallel_size=1)

The inverse of megatron.logical_from_megatron: mp's logical tensors are named and
fused back into Megatron's layouts (QKV interleaved by query group, a SwiGLU fc1 as
[gate; up]) as the family tables' Megatron view says (mp_ckpt.families.megatron_view),
and written as

- torch_dist: one torch.distributed.checkpoint folder saved by this process
  alone; layers stacked on a leading axis, norms under the names Megatron's
  sharded state dict gives them (`linear_qkv.layer_norm_weight`,
  `linear_fc1.layer_norm_weight`), a None `_extra_state` byte item per linear
  layer, the `common_state` byte item (args, iteration, checkpoint_version) and
  metadata.json. The tensors are global: any TP x PP loads them.
- torch (legacy): iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt per TP,
  PP and EP rank, each with the rank's TP slices under per-stage layer numbers
  and its experts as mlp.experts.local_experts.<local number>.

Multi-latent attention keeps its names (mp's are Megatron's local spec's); in
torch_dist its latent norms are written under the local spec's names and, beside them,
the TE spec's (q_layernorm also as linear_q_up_proj.layer_norm_weight, kv_layernorm as
linear_kv_up_proj.layer_norm_weight, pre_mlp_layernorm as linear_fc1.layer_norm_weight)
so that either spec loads it (megatron_view.py); the legacy files have the local spec's
names and its layout (the down projections split on rows over TP). DeepSeek's sparse
attention adds its indexer (self_attention.core_attention.indexer.*), whole on every TP
rank; megatron-core builds it with Transformer Engine's spec alone, so its legacy files
are written at TP 1 only (export_checks.py).

A hybrid model is written as megatron-core's HybridModel saves it: in torch_dist layer
by layer (its layers differ), each Mamba mixer's in_proj and conv1d as their parts
(mixer.in_proj.weight.z, ..., mixer.conv1d.weight.x, ...), the layers' norms under both
the Transformer Engine spec's and the local spec's names (megatron_view.py), the final
norm as decoder.final_norm; in the legacy files under the local spec's names (norm,
input_layernorm, pre_mlp_layernorm; mixer.conv1d_weight and conv1d_bias), each TP rank's
in_proj and conv1d its rows of every part.

A mixture-of-experts model is written as Megatron's MoE layers save themselves:
the experts' weights under mlp.experts.experts.* ([E, ...], global numbers) in
torch_dist, the router (and its expert bias) and the shared expert under their
names. When only some layers are MoE, Megatron saves torch_dist layer by layer
(no stacking) and moe_layer_freq is recorded as a 0/1 list; when all are, as 1.

Only the model is written: no optimizer state, no RNG state, no scheduler.
Megatron loads it with --no-load-optim --no-load-rng (or --finetune). The
pickles hold only builtins, torch tensors and an argparse.Namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

import torch

from mp_ckpt.core.progress import progress as progress_reporter
from mp_ckpt.core.reader import CheckpointReader
from mp_ckpt.families.megatron_view import MegatronView, megatron_view, split_name
from mp_ckpt.families.moe import is_moe_layer
from mp_ckpt.families.table import Dims
from mp_ckpt.megatron.export_checks import check_exportable, refuse_mp_only_settings
from mp_ckpt.megatron.linear_attention import linear_attention_args
from mp_ckpt.megatron.read import _LAYER
from mp_ckpt.megatron.settings import (
    MAMBA_COPIED,
    MLA_COPIED,
    MLA_YARN,
    MOE_COPIED,
    YARN_ARGS,
    gated,
)
from mp_ckpt.megatron.sparse_attention import sparse_attention_args
from mp_ckpt.megatron.tp_layout import mamba_parts, tp_piece

__all__ = ["export_megatron", "megatron_args", "megatron_from_logical"]

CHECKPOINT_VERSION = 3.0
_LINEAR_WEIGHT = re.compile(
    r"^((?:decoder|mtp)\.layers\..*\.(?:linear_qkv|linear_proj|linear_fc[12]|linear_q_proj"
    r"|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj|linear_kv_up_proj|eh_proj"
    r"|mixer\.in_proj|mixer\.out_proj|self_attention\.in_proj|self_attention\.out_proj"
    r"|indexer\.linear_wq_b|indexer\.linear_wk|indexer\.linear_weights_proj))\.weight$"
)
# The experts' stacked tensors (torch_dist names): [E, ...]
_STACKED_EXPERTS = re.compile(
    r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer"
    r"(?:\.layers\.\d+)?))"
    r"\.mlp\.experts\.)experts\.(.+)$"
)
# A Mamba mixer's convolution: torch_dist's names; the legacy files' are conv1d_weight / _bias
_CONV = re.compile(r"\.mixer\.conv1d\.(weight|bias)$")
# A multi-token prediction module's layer: megatron-core's module name in the legacy files
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.)transformer_layer\.")


def megatron_from_logical(logical: dict[str, torch.Tensor],
                          settings: dict) -> dict[str, torch.Tensor]:  # fmt: skip
    """Megatron's whole tensors (per-layer keys, local-spec names) from mp's logical ones."""
    refuse_mp_only_settings(settings)
    view = megatron_view(settings)
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, tuple] = {}  # Megatron name -> (its MegatronTensor, {index: mp tensor})
    for key, tensor in logical.items():
        prefix, rest, where = split_name(key)
        found = view.holding(rest, where)
        if found is None:
            raise ValueError(f"{key}: no place for this tensor in Megatron's GPTModel")
        held, j = found
        if held.fusion is None:
            out[prefix + held.name] = tensor
        else:
            fused.setdefault(prefix + held.name, (held, {}))[1][j] = tensor
    for name, (held, parts) in fused.items():
        if len(parts) != len(held.mp):
            missing = [mp for i, mp in enumerate(held.mp) if i not in parts]
            raise ValueError(f"{name}: mp's {', '.join(missing)} missing beside the others")
        out[name] = held.fuse([parts[i] for i in range(len(held.mp))])
    if not settings.get("untie_embeddings_and_output_weights"):
        out.pop("output_layer.weight", None)
    return out


def _divisible_by(vocab: int, tp: int) -> int:
    """The largest of Megatron's --make-vocab-size-divisible-by (128, 64, ... 1) under which
    Megatron pads its vocabulary to exactly `vocab` rows at this TP (a multiple of it x TP)."""
    return next(d for d in (128, 64, 32, 16, 8, 4, 2, 1) if vocab % (d * tp) == 0)


def megatron_args(settings: dict, *, ckpt_format: str, tp: int, pp: int, iteration: int,
                  data: dict | None = None, ep: int = 1) -> argparse.Namespace:  # fmt: skip
    """Megatron's argument names for the model's settings (those Megatron's load checks
    and the ones a run needs to rebuild the same GPTModel); `data` is the training run's
    data settings (tokenizer_type and its files), when the mp checkpoint recorded them."""
    refuse_mp_only_settings(settings)
    heads, groups = settings["num_attention_heads"], settings["num_query_groups"]
    activation = settings.get("activation", "gelu")
    position = settings.get("position_embedding_type", "learned_absolute")
    vocab = settings["vocab_size"]
    seq = settings.get("seq_length") or settings["max_position_embeddings"]
    values = {
        "num_layers": settings["num_layers"], "hidden_size": settings["hidden_size"],
        "num_attention_heads": heads, "num_query_groups": groups,
        "group_query_attention": groups != heads,
        "kv_channels": settings["kv_channels"], "ffn_hidden_size": settings["ffn_hidden_size"],
        "normalization": settings.get("normalization", "LayerNorm"),
        "norm_epsilon": settings.get("layernorm_epsilon", 1e-5),
        "swiglu": activation == "swiglu", "squared_relu": activation == "squared_relu",
        "quick_geglu": bool(settings.get("quick_geglu", False)),
        "glu_linear_offset": settings.get("glu_linear_offset", 0.0),
        "activation_func_clamp_value": settings.get("activation_func_clamp_value"),
        "openai_gelu": bool(settings.get("openai_gelu", False)),
        "position_embedding_type": position,
        # Megatron's default; the embedding type alone decides the model's layout
        "add_position_embedding": True,
        "rotary_base": settings.get("rotary_base", 10000),
        "rotary_percent": settings.get("rotary_percent", 1.0),
        "rotary_seq_len_interpolation_factor":
            settings.get("rotary_seq_len_interpolation_factor"),
        "use_rope_scaling": bool(settings.get("use_rope_scaling", False)),
        "rope_scaling_factor": settings.get("rope_scaling_factor", 8.0),
        "untie_embeddings_and_output_weights":
            bool(settings.get("untie_embeddings_and_output_weights", False)),
        "add_bias_linear": bool(settings.get("add_bias_linear", True)),
        "add_qkv_bias": bool(settings.get("add_qkv_bias", False)),
        "qk_layernorm": bool(settings.get("qk_layernorm", False)),
        "hidden_dropout": settings.get("hidden_dropout", 0.1),
        "attention_dropout": settings.get("attention_dropout", 0.1),
        "init_method_std": settings.get("init_method_std", 0.02),
        "padded_vocab_size": vocab,
        "make_vocab_size_divisible_by": _divisible_by(vocab, tp),
        "max_position_embeddings": settings["max_position_embeddings"], "seq_length": seq,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "ckpt_format": ckpt_format, "iteration": iteration,
        "num_experts": None, "expert_model_parallel_size": 1,
        "apply_layernorm_1p": bool(settings.get("apply_layernorm_1p", False)),
        **_llama4_args(settings),
        "apply_residual_connection_post_layernorm": False,
        "multi_latent_attention": bool(settings.get("multi_latent_attention", False)),
        "mtp_num_layers": settings.get("mtp_num_layers"),
        "mtp_loss_scaling_factor": settings.get("mtp_loss_scaling_factor", 0.1),
        "mtp_use_repeated_layer": bool(settings.get("mtp_use_repeated_layer", False)),
        **_hybrid_args(settings),
        **linear_attention_args(settings),
        **sparse_attention_args(settings),
        "consumed_train_samples": 0, "skipped_train_samples": 0, "consumed_valid_samples": 0,
        "data_parallel_random_init": False,
    }  # fmt: skip
    for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"):
        values[name] = (data or {}).get(name)
    window = settings.get("window_size")
    values |= {"softmax_type": settings.get("softmax_type", "vanilla"),
               "window_size": tuple(window) if window else None,
               "window_attn_skip_freq": settings.get("window_attn_skip_freq")}  # fmt: skip
    if position == "yarn":
        values |= {arg: settings.get(field, default)
                   for arg, (field, default) in YARN_ARGS.items()}  # fmt: skip
    if values["multi_latent_attention"]:
        values |= _mla_args(settings)
    if settings.get("num_moe_experts"):
        values |= _moe_args(settings, tp, ep)
    return argparse.Namespace(**values)


def _hybrid_args(settings: dict) -> dict:
    """A hybrid model's args (HybridModel's): its layer pattern and Mamba widths; a GPT
    model's hybrid_layer_pattern is None."""
    pattern = settings.get("hybrid_layer_pattern")
    if not pattern:
        return {"hybrid_layer_pattern": None, "is_hybrid_model": False}
    widths = {name: settings.get(name, default) for name, default in MAMBA_COPIED.items()}
    return {"hybrid_layer_pattern": pattern, "is_hybrid_model": True, **widths}


def _llama4_args(settings: dict) -> dict:
    """Llama 4's attention args: interleaved rotary pairs, NoPE layers, qk_l2_norm, which
    Megatron applies on every layer (mp's qk_l2_norm_layers "rope", Llama 4's, only where
    every layer rotates). Megatron has no chunked attention or temperature tuning."""
    freq = settings.get("no_rope_freq")
    nope = bool(freq) if isinstance(freq, int) else any(freq or ())
    layers = settings.get("qk_l2_norm_layers", "all")
    if settings.get("qk_l2_norm") and layers != "all" and nope:
        raise ValueError(
            f"model_config qk_l2_norm_layers={layers!r}: Megatron-LM normalizes the queries "
            "and keys of every layer, the no_rope_freq layers' too"
        )
    for name in ("attention_chunk_size", "attn_temperature_floor_scale"):
        if settings.get(name) is not None:
            raise ValueError(f"model_config {name}={settings[name]!r}: Megatron-LM has no "
                             "such attention (Llama 4's)")  # fmt: skip
    return {
        "rotary_interleaved": bool(settings.get("rotary_interleaved", False)),
        "no_rope_freq": freq,
        "qk_l2_norm": bool(settings.get("qk_l2_norm", False)),
    }


def _mla_args(settings: dict) -> dict:
    """Multi-latent attention's args: its widths, rope_type, and YaRN's factor and mscales
    (Megatron's MLA takes the other YaRN fields from MLATransformerConfig's defaults)."""
    values = {name: settings.get(name, default) for name, default in MLA_COPIED.items()}
    rope_type = settings.get("rope_type") or "yarn"
    values |= {"rope_type": rope_type, "rotary_scaling_factor": 1.0, "mscale": 1.0,
               "mscale_all_dim": 0.0}  # fmt: skip
    if rope_type == "yarn":
        for field, fixed in MLA_YARN.items():
            if settings.get(field, fixed) != fixed:
                raise ValueError(
                    f"model_config {field}={settings[field]!r}: Megatron's multi-latent "
                    f"attention computes YaRN with {fixed!r} (no argument sets it)"
                )
        values |= {"rotary_scaling_factor": settings.get("yarn_rotary_scaling_factor", 1.0),
                   "mscale": settings.get("yarn_mscale", 1.0),
                   "mscale_all_dim": settings.get("yarn_mscale_all_dim", 0.0)}  # fmt: skip
    return values


def _moe_layer_freq(settings: dict) -> int | list[int]:
    """Megatron's moe_layer_freq: 1 when every layer is MoE (Megatron then stacks the layers
    in torch_dist, as for a dense model), else one 0/1 per layer (saved layer by layer); a
    hybrid model's 1, Megatron's default (its pattern's E layers are the MoE ones)."""
    if settings.get("hybrid_layer_pattern"):
        return 1
    pattern = [int(is_moe_layer(settings, i)) for i in range(settings["num_layers"])]
    return 1 if all(pattern) else pattern


def _moe_args(settings: dict, tp: int, ep: int) -> dict:

    values = {name: settings.get(name, default) for name, default in MOE_COPIED.items()}
    return values | {
        "num_experts": settings["num_moe_experts"],
        "moe_ffn_hidden_size": settings.get("moe_ffn_hidden_size") or settings["ffn_hidden_size"],
        "moe_router_load_balancing_type": settings.get("moe_router_load_balancing_type",
                                                       "aux_loss"),
        "moe_aux_loss_coeff": settings.get("moe_aux_loss_coeff", 0.0),
        "moe_token_dispatcher_type": settings.get("moe_token_dispatcher_type", "allgather"),
        "moe_layer_freq": _moe_layer_freq(settings),
        "expert_model_parallel_size": ep, "expert_tensor_parallel_size": tp,
    }  # fmt: skip


def _read_mp(src: str | os.PathLike):
    """The checkpoint's reader, model keys, settings (Megatron names) and data settings."""

    reader = CheckpointReader(src)
    common = torch.load(reader.directory / "common.pt", weights_only=False)
    common = common if isinstance(common, dict) else {}
    run_model = (common.get("config") or {}).get("model") or {}
    settings = dict(run_model) | dict(common.get("model_config") or {})
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                           "max_position_embeddings") if settings.get(n) is None]  # fmt: skip
    if missing:
        raise ValueError(f"{reader.directory}: common.pt's model settings lack {missing}")
    heads = settings["num_attention_heads"]
    settings.setdefault("num_query_groups", heads)
    settings["num_query_groups"] = settings["num_query_groups"] or heads
    settings.setdefault("kv_channels", settings["hidden_size"] // heads)
    settings["kv_channels"] = settings["kv_channels"] or settings["hidden_size"] // heads
    settings.setdefault("ffn_hidden_size", 4 * settings["hidden_size"])
    keys = [k for k in reader.keys if not k.startswith("optimizer.")]
    data = (common.get("config") or {}).get("data") or {}
    return reader, keys, settings, data


def export_megatron(src: str | os.PathLike, dst: str | os.PathLike, *,
                    ckpt_format: str = "torch_dist", tensor_model_parallel_size: int = 1,
                    pipeline_model_parallel_size: int = 1,
                    expert_model_parallel_size: int = 1,
                    progress: bool = False) -> Path:  # fmt: skip
    """Writes dst/latest_checkpointed_iteration.txt and dst/iter_XXXXXXX (the mp
    checkpoint's iteration) with the model's weights; returns the iteration folder.
    progress: report the tensors read on stderr (progress.py)."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    ep = expert_model_parallel_size
    reader, keys, settings, data = _read_mp(src)
    check_exportable(settings, keys, tp, pp, ckpt_format, ep)
    iteration, logical = reader.iteration, {}
    args = megatron_args(settings, ckpt_format=ckpt_format, tp=tp, pp=pp, iteration=iteration,
                         data=data, ep=ep)  # fmt: skip
    with progress_reporter(len(keys), "export-megatron", unit="tensor", enabled=progress) as bar:
        for key in keys:
            logical[key] = reader.read(key)
            bar.update()
    tensors = megatron_from_logical(logical, settings)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    final = dst / f"iter_{iteration:07d}"
    work = dst / f".iter_{iteration:07d}.writing"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    if ckpt_format == "torch_dist":
        _write_torch_dist(work, tensors, args, iteration, megatron_view(settings),
                          Dims.of(settings))  # fmt: skip
    else:
        _write_torch(work, tensors, args, iteration, tp, pp, ep)
    if final.exists():
        shutil.rmtree(final)
    os.replace(work, final)
    # The tracker last, itself renamed into place: Megatron sees the iteration only whole.
    tracker = dst / ".latest_checkpointed_iteration.txt.writing"
    tracker.write_text(str(iteration))
    os.replace(tracker, dst / "latest_checkpointed_iteration.txt")
    return final


def _common(args, iteration: int) -> dict:
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
            "num_floating_point_operations_so_far": 0}  # fmt: skip


def _writer_class():
    import torch.distributed.checkpoint as dcp

    class _Writer(dcp.FileSystemWriter):
        """DCP's writer, recording its checkpoint_id as a str (not a PosixPath) so that
        the .metadata pickle holds no class outside torch's own records."""

        def storage_meta(self):
            meta = super().storage_meta()
            if meta is not None:
                meta.checkpoint_id = str(meta.checkpoint_id) if meta.checkpoint_id else None
            return meta

    return _Writer


def _write_torch_dist(work: Path, tensors: dict[str, torch.Tensor], args, iteration: int,
                      view: MegatronView, dims: Dims) -> None:  # fmt: skip
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from mp_ckpt.core.checkpointer import single_process_quiet

    _Writer = _writer_class()
    layers = args.num_layers
    # Megatron stacks the layers on a leading axis unless they differ (some MoE, some dense;
    # a hybrid model's; some with gated DeltaNets)
    stack = not isinstance(getattr(args, "moe_layer_freq", 1), list)
    stack = stack and not args.hybrid_layer_pattern
    stack = stack and args.experimental_attention_variant != "gated_delta_net"
    stacked: dict[str, list] = {}
    state: dict[str, object] = {}
    for key, tensor in tensors.items():
        prefix, rest, where = split_name(key)
        held = view.named(rest, where) if where == "layer" else None
        layer = _LAYER.match(key)  # a decoder layer's (a multi-token prediction's: apart)
        if held is not None and held.split_parts:  # a Mamba mixer's in_proj or conv1d
            for part, piece in zip(held.split_parts, tensor.split(held.part_rows(dims)),
                                   strict=True):  # fmt: skip
                state[f"{prefix}{held.name}.{part}"] = piece.contiguous()
            continue
        # the names Megatron's sharded state dict gives it (a norm's TE names: megatron_view)
        for name in held.dist_names if held is not None else (rest,):
            if stack and layer is not None:
                stacked.setdefault(name, [None] * layers)[int(layer.group(1))] = tensor
            else:
                state[prefix + name] = tensor.contiguous()
    for rest, per_layer in stacked.items():
        if any(t is None for t in per_layer):
            raise ValueError(f"decoder.layers.*.{rest}: missing in some layers")
        state[f"decoder.layers.{rest}"] = torch.stack(per_layer).contiguous()
    experts = getattr(args, "num_experts", None) or 0
    modules = _linear_modules(tensors)
    if args.hybrid_layer_pattern:  # HybridModel's output layer saves its extra state too
        modules.append("output_layer")
    for module in modules:
        # a None byte item per linear layer, named by its place in the [layers] (and, for
        # the experts, [experts]) grid Megatron shards it over
        match = _LAYER.match(module)
        stacked_here = stack and match is not None
        per_expert = ".experts.experts." in module
        for e in range(experts) if per_expert else [None]:
            offsets = ([int(match.group(1))] if stacked_here else []) + ([e] if per_expert else [])
            shape = ([layers] if stacked_here else []) + ([experts] if per_expert else [])
            offsets, shape = offsets or [0], shape or [1]
            prefix = f"decoder.layers.{match.group(2)}" if stacked_here else module
            name = (f"{prefix}._extra_state/shard_{'.'.join(map(str, offsets))}_"
                    f"{'.'.join(map(str, shape))}")  # fmt: skip
            state[name] = [None]
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    common = _common(args, iteration) | {"content_metadata": content}
    state["common_state/shard_0_1"] = [common]
    with single_process_quiet():
        dcp.save(state, storage_writer=_Writer(work), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False))  # fmt: skip
    (work / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )


def _linear_modules(keys) -> list[str]:
    """The linear layers among the keys' modules (each has an _extra_state entry)."""
    found = []
    for key in keys:
        match = _LINEAR_WEIGHT.match(key)
        if match:
            found.append(match.group(1))
    return found


def _expert_pieces(model: dict, ep_rank: int, ep: int) -> dict:
    """A rank's model: the experts' [E, ...] tensors cut into its local experts, numbered
    from 0 (mlp.experts.local_experts.<l>.*), everything else as it is."""
    out = {}
    for key, tensor in model.items():
        match = _STACKED_EXPERTS.match(key)
        if match is None:
            out[key] = tensor
            continue
        local = tensor.shape[0] // ep
        for index in range(local):
            name = f"{match.group(1)}local_experts.{index}.{match.group(2)}"
            out[name] = tensor[ep_rank * local + index]
    return out


def _write_torch(work: Path, tensors: dict[str, torch.Tensor], args, iteration: int,
                 tp: int, pp: int, ep: int) -> None:  # fmt: skip
    per_stage = args.num_layers // pp
    swiglu, parts = gated(args), mamba_parts(args)
    tied = not args.untie_embeddings_and_output_weights
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        model: dict[str, object] = {}
        for key, tensor in tensors.items():
            match = _LAYER.match(key)
            if match:
                layer = int(match.group(1))
                if layer // per_stage != stage:
                    continue
                model[f"decoder.layers.{layer - stage * per_stage}.{match.group(2)}"] = tensor
            elif key.startswith("embedding."):
                if first:
                    model[key] = tensor
            elif last:
                model[_MTP_LAYER.sub(r"\1mtp_model_layer.", key)] = tensor
        if last and tied and pp > 1:  # the last stage's copy of the shared embedding
            model["output_layer.weight"] = tensors["embedding.word_embeddings.weight"]
        if last and not first and getattr(args, "mtp_num_layers", None):
            # the multi-token prediction modules' copy of the word embedding
            model["embedding.word_embeddings.weight"] = tensors["embedding.word_embeddings.weight"]
        for e in range(ep):
            local_model = _expert_pieces(model, e, ep)
            for module in _linear_modules(list(local_model)):
                local_model[f"{module}._extra_state"] = None
            if last:
                local_model["output_layer._extra_state"] = None
            for rank in range(tp):
                local = {
                    _CONV.sub(r".mixer.conv1d_\1", k): (
                        v
                        if v is None
                        else tp_piece(k, v, rank, tp, swiglu, parts).clone().contiguous()
                    )
                    for k, v in local_model.items()
                }
                name = (f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
                        + (f"_{e:03d}" if ep > 1 else ""))  # fmt: skip
                (work / name).mkdir()
                torch.save(_common(args, iteration) | {"model": local},
                           work / name / "model_optim_rng.pt")  # fmt: skip
