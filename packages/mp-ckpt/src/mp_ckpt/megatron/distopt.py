"""The distributed optimizer's Adam state in a Megatron-LM checkpoint, as whole tensors.

    read_distributed_buckets(model, tensors, raw) -> states       torch_dist
    read_distrib_optim(model, files) -> states                    legacy distrib_optim.pt

(`states`: {"exp_avg" | "exp_avg_sq" | "param": {model.tensors name: whole tensor}}.)

Megatron's DDP packs each pipeline stage's TP-local parameters into one flat grad buffer
per dtype ("gbuf"), in reverse module (named_parameters) order, every parameter starting at
a multiple of 64 elements, and cuts the buffer into buckets: a bucket closes after the
parameter whose end reaches `bucket_size` elements past the bucket's start (no bucket size:
one bucket). Each bucket's end is padded to a multiple of lcm(DP, 128), so every bucket
starts 64-aligned and offsets inside a bucket follow the same 64-element rule. The
distributed optimizer gives each DP rank one contiguous 1/DP of every (padded) bucket.

What the checkpoint holds, per data-parallel group g (one per model-parallel rank,
g = pp_rank * TP + tp_rank) and its buffer 0:

- torch_dist (`dp_reshardable`): per bucket b one global tensor per state,
  "optimizer.distributed.dp_group_idx_<g>.gbuf_idx_0.dtype_(...).bucket_idx_<b>.<state>",
  of the bucket's *unpadded* size (its last parameter's end; the DP padding is cut and
  each DP rank writes its chunk). "...per_bucket_numel_unpadded" lists those sizes
  ([{(param dtype, grad dtype): [numel per bucket]}] per buffer) and "...per_bucket_numel"
  the padded ones; they mark the bucket boundaries, so the bucketing rule is not needed.
- legacy torch: each model-parallel rank's folder holds `distrib_optim.pt`, written by DP
  rank 0: {"buckets_coalesced": True, 0: {(param dtype, grad dtype): {"param", "exp_avg",
  "exp_avg_sq": one flat tensor, "numel_unpadded": int}}}: the buckets' unpadded contents
  concatenated over the whole buffer. No bucket size is stored, so the boundaries are
  rebuilt from the saved args: `--ddp-bucket-size` when `--overlap-grad-reduce` is on
  (Megatron-LM buckets only then), none on pipeline stages after the first; the sizes must
  add up to "numel_unpadded".

A layout this cannot map (several buffers: virtual pipeline stages or mixed dtypes, an
uneven pipeline split, a bucket of another size) is refused with the file and key.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mp_ckpt.megatron.order import megatron_param_order
from mp_ckpt.megatron.read import _LAYER, MegatronModel
from mp_ckpt.megatron.safe_pickle import safe_load
from mp_ckpt.megatron.settings import gated
from mp_ckpt.megatron.tp_layout import join_pieces, mamba_parts, tp_piece

__all__ = ["ALIGN", "buffer_params", "megatron_buckets", "place", "read_distrib_optim",
           "read_distributed_buckets"]  # fmt: skip

STATES = ("exp_avg", "exp_avg_sq", "param")
# model tensors that are buffers, not parameters
_BUFFERS = ("mlp.router.expert_bias", "mlp.router.qb_beta")
ALIGN = 64  # every parameter starts at a multiple of 64 elements in its grad buffer
# torch_dist names the local spec's norms as TE's fused ones; the modules are the norms.
_LOCAL_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    "mixer.in_proj.layer_norm_weight": "norm.weight",  # a hybrid model's Mamba layer
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",  # a gated DeltaNet's
}
# args that split the layers unevenly over the stages or into virtual stages
_UNEVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
           "num_layers_per_virtual_pipeline_stage", "pipeline_model_parallel_layout",
           "account_for_embedding_in_pipeline_split",
           "account_for_loss_in_pipeline_split")  # fmt: skip
# torch_dist's experts of a layer, stacked [E, ...] (the buffer holds one per expert)
_LAYER_OF_EXPERTS = (
    r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts\.)"
)
_STACKED_EXPERTS = re.compile(_LAYER_OF_EXPERTS + r"experts\.(.+)$")
_ONE_EXPERT = re.compile(_LAYER_OF_EXPERTS + r"local_experts\.(\d+)\.(.+)$")
_FLAT = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.(dtype_.*)\.bucket_idx_(\d+)"
    r"\.(param|exp_avg|exp_avg_sq)$"
)


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _sizes(args) -> tuple[int, int, int]:
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    return tp, pp, int(args.num_layers)


def buffer_params(model: MegatronModel, stage: int, rank: int, where: str):
    """[(model.tensors name, TP-local shape)] of one pipeline stage and TP rank, in the
    order Megatron packs its grad buffer (reverse module order). torch_dist's stacked
    experts [E, ...] are there expert by expert, under the legacy per-expert names
    (mlp.experts.local_experts.<e>.*; _join_states stacks them back)."""
    args = model.args
    tp, pp, layers = _sizes(args)
    if layers % pp or any(getattr(args, a, None) for a in _UNEVEN):
        raise ValueError(f"{where}: only an even pipeline split of {layers} layers over "
                         f"{pp} stages without virtual stages is imported")  # fmt: skip
    untied = bool(getattr(args, "untie_embeddings_and_output_weights", False))
    if pp > 1 and not untied:
        raise ValueError(f"{where}: tied embeddings under pipeline parallelism (the last "
                         "stage's shared copy) are not imported")  # fmt: skip
    if pp > 1 and getattr(args, "mtp_num_layers", None):
        raise ValueError(f"{where}: multi-token prediction under pipeline parallelism (the "
                         "last stage's copy of the embedding) is not imported")  # fmt: skip
    per_stage = layers // pp
    local_spec = getattr(args, "transformer_impl", "local") == "local"
    swiglu, parts = gated(args), mamba_parts(args)
    names, experts = {}, {}
    for name in model.tensors:
        if name.endswith(_BUFFERS):
            continue  # not a parameter: no place in the grad buffer
        stacked = _STACKED_EXPERTS.match(name)
        if stacked:
            shape = _shape(model.tensors, name)
            for e in range(shape[0]):
                one = f"{stacked.group(1)}local_experts.{e}.{stacked.group(2)}"
                experts[one] = shape[1:]
            layer = _LAYER.match(name)  # a multi-token prediction module's: the last stage
            if (int(layer.group(1)) // per_stage if layer else pp - 1) == stage:
                names.update({one: one for one in experts if one.startswith(stacked.group(1))})
            continue
        match = _LAYER.match(name)
        if match:
            if int(match.group(1)) // per_stage != stage:
                continue
            if local_spec and match.group(2) in _LOCAL_NORMS:
                names[f"decoder.layers.{match.group(1)}.{_LOCAL_NORMS[match.group(2)]}"] = name
                continue
        elif (
            (name.startswith("embedding.") and stage != 0)
            or (not name.startswith("embedding.") and stage != pp - 1)
            or (name == "output_layer.weight" and not untied)
        ):
            continue
        names[name] = name
    out = []
    for name in reversed(megatron_param_order(names, where)):
        # the whole tensor's shape, not its data (MegatronTensors reads on lookup)
        shape = experts.get(name) or _shape(model.tensors, names[name])
        whole = torch.empty(shape, device="meta")
        out.append((names[name], tp_piece(name, whole, rank, tp, swiglu, parts).shape))
    return out


def _shape(tensors, name: str) -> tuple[int, ...]:
    shape = getattr(tensors, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(tensors[name].shape)


def megatron_buckets(numels: list[int], bucket_size: int | None) -> list[int]:
    """Unpadded bucket sizes of a buffer holding parameters of `numels` elements (buffer
    order): a bucket closes after the parameter that reaches `bucket_size` elements."""
    sizes, offset, end = [], 0, 0
    for numel in numels:
        end = _align(offset) + numel
        if bucket_size is not None and end >= bucket_size:
            sizes.append(end)
            offset = end = 0
        else:
            offset = end
    if end:
        sizes.append(end)
    return sizes


def place(shapes: list, unpadded: list[int], where: str) -> list[tuple[int, int]]:
    """(bucket, offset in bucket) of each parameter, given the buckets' unpadded sizes:
    a parameter whose aligned start reaches its bucket's unpadded end opens the next."""
    spans, bucket, offset = [], 0, 0
    for shape in shapes:
        start = _align(offset)
        if offset and start >= unpadded[bucket]:
            bucket, start = bucket + 1, 0
            if bucket == len(unpadded):
                raise ValueError(f"{where}: the model's parameters overflow the "
                                 f"{len(unpadded)} buckets {unpadded}")  # fmt: skip
        spans.append((bucket, start))
        offset = start + shape.numel()
        if offset > unpadded[bucket]:
            raise ValueError(f"{where}: bucket {bucket} holds {unpadded[bucket]} elements; "
                             f"the model's parameters reach {offset}")  # fmt: skip
    if bucket != len(unpadded) - 1 or offset != unpadded[bucket]:
        raise ValueError(f"{where}: the model's parameters fill {bucket + 1} buckets up to "
                         f"{offset}, the checkpoint's buckets are {unpadded}")  # fmt: skip
    return spans


def _join_states(model: MegatronModel, pieces: dict) -> dict:
    """{state: {name: whole tensor}} from {state: {name: [TP pieces in rank order]}}."""
    swiglu, parts = bool(getattr(model.args, "swiglu", False)), mamba_parts(model.args)
    out = {}
    for state, by_name in pieces.items():
        joined = {
            n: join_pieces(n, p, swiglu, None, parts).contiguous() for n, p in by_name.items()
        }
        stacks: dict[str, dict[int, torch.Tensor]] = {}
        for name in list(joined):
            one = _ONE_EXPERT.match(name)
            stacked = one and f"{one.group(1)}experts.{one.group(3)}"
            if stacked and name not in model.tensors and stacked in model.tensors:
                stacks.setdefault(stacked, {})[int(one.group(2))] = joined.pop(name)
        for stacked, by_expert in stacks.items():
            joined[stacked] = torch.stack([by_expert[e] for e in range(len(by_expert))])
        out[state] = joined
    return out


def _only(value, key: str, where):
    """The one (param dtype, grad dtype) entry of a per-buffer dict."""
    if not isinstance(value, dict) or len(value) != 1:
        found = list(value) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"{where}: {key}: expected one (param dtype, grad dtype) entry, "
                         f"found {found}")  # fmt: skip
    return next(iter(value.values()))


def read_distributed_buckets(model: MegatronModel, tensors: dict, raw: dict) -> dict:
    """torch_dist's dp_reshardable buckets (`tensors`: the flat tensors by key; `raw`: the
    byte entries, unpickled) -> {state: {name: tensor}}."""
    directory = model.directory
    tp, pp, _ = _sizes(model.args)
    flat: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        match = _FLAT.match(key)
        if match is None:
            continue
        if match.group(2) != "0":
            raise ValueError(f"{directory}: {key}: several grad buffers (virtual pipeline "
                             "stages or mixed dtypes) are not imported")  # fmt: skip
        group, bucket = int(match.group(1)), int(match.group(4))
        flat.setdefault(group, {}).setdefault(bucket, {})[match.group(5)] = value
    if not flat:
        found = next((k for k in tensors if k.startswith("optimizer.distributed.")), None)
        raise ValueError(f"{directory}: no optimizer.distributed.dp_group_idx_*.gbuf_idx_*."
                         "bucket_idx_* tensors: only the dp_reshardable sharding is imported"
                         + (f" (found {found})" if found else ""))  # fmt: skip
    if sorted(flat) != list(range(tp * pp)):
        raise ValueError(f"{directory}: optimizer.distributed.dp_group_idx_*: groups "
                         f"{sorted(flat)} for TP {tp} x PP {pp} (expected one per "
                         "model-parallel rank)")  # fmt: skip
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {s: {} for s in STATES}
    for stage in range(pp):
        for rank in range(tp):
            group = stage * tp + rank
            prefix = f"optimizer.distributed.dp_group_idx_{group}"
            where = f"{directory}: {prefix}.per_bucket_numel_unpadded"
            sizes = raw.get(f"{prefix}.per_bucket_numel_unpadded/shard_0_1")
            sizes = sizes[0] if isinstance(sizes, list) and len(sizes) == 1 else sizes
            if not isinstance(sizes, list) or len(sizes) != 1:
                raise ValueError(f"{where}: expected the bucket sizes of one grad buffer, "
                                 f"found {sizes!r}")  # fmt: skip
            unpadded = [int(n) for n in _only(sizes[0], "per_bucket_numel_unpadded", where)]
            if sorted(flat[group]) != list(range(len(unpadded))):
                raise ValueError(f"{where}: {len(unpadded)} buckets, the checkpoint holds "
                                 f"bucket_idx {sorted(flat[group])}")  # fmt: skip
            params = buffer_params(model, stage, rank, f"{directory}: {prefix}")
            spans = place([s for _, s in params], unpadded, where)
            for b, numel in enumerate(unpadded):
                for state in STATES:
                    value = flat[group][b].get(state)
                    if value is None or value.numel() != numel:
                        raise ValueError(
                            f"{directory}: {prefix}.gbuf_idx_0.bucket_idx_{b}.{state}: "
                            f"{'missing' if value is None else f'{value.numel()} elements'}, "
                            f"per_bucket_numel_unpadded says {numel}"
                        )
            for (name, shape), (b, start) in zip(params, spans, strict=True):
                for state in STATES:
                    piece = flat[group][b][state][start : start + shape.numel()].view(shape)
                    pieces[state].setdefault(name, []).append(piece)
    return _join_states(model, pieces)


def _legacy_bucket_size(args, stage: int, where: Path) -> int | None:
    """The bucket size Megatron-LM's training loop gave this stage's grad buffer."""
    if not getattr(args, "overlap_grad_reduce", False) or stage > 0:
        return None
    if getattr(args, "ddp_num_buckets", None):
        raise ValueError(f"{where}: buckets set by --ddp-num-buckets are not imported")
    size = getattr(args, "ddp_bucket_size", None)
    if size is None:
        dp = int(getattr(args, "data_parallel_size", 1) or 1)
        cp = int(getattr(args, "context_parallel_size", 1) or 1)
        size = max(40_000_000, 1_000_000 * dp * cp)
    return int(size)


def read_distrib_optim(model: MegatronModel, files: dict[tuple[int, int], Path]) -> dict:
    """Legacy `distrib_optim.pt` files ({(stage, tp rank): path}) -> {state: {name: tensor}}."""
    tp, pp, _ = _sizes(model.args)
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {s: {} for s in STATES}
    for stage in range(pp):
        for rank in range(tp):
            path = files[(stage, rank)]
            saved = safe_load(path)
            if not isinstance(saved, dict) or not saved.get("buckets_coalesced"):
                raise ValueError(f"{path}: buckets_coalesced: not set (the per-bucket layout "
                                 "of older Megatron versions is not imported)")  # fmt: skip
            buffers = sorted(k for k in saved if k != "buckets_coalesced")
            if buffers != [0]:
                raise ValueError(f"{path}: grad buffers {buffers}: only one (index 0) is "
                                 "imported")  # fmt: skip
            buffer = _only(saved[0], "0", path)
            params = buffer_params(model, stage, rank, str(path))
            numels = [s.numel() for _, s in params]
            unpadded = megatron_buckets(numels, _legacy_bucket_size(model.args, stage, path))
            total = buffer.get("numel_unpadded")
            if total != sum(unpadded):
                raise ValueError(f"{path}: 0.numel_unpadded is {total}; the model's "
                                 f"parameters in Megatron's buckets {unpadded} hold "
                                 f"{sum(unpadded)}")  # fmt: skip
            starts = [sum(unpadded[:b]) for b in range(len(unpadded))]
            spans = place([s for _, s in params], unpadded, str(path))
            for state in STATES:
                value = buffer.get(state)
                if not isinstance(value, torch.Tensor) or value.numel() != total:
                    raise ValueError(f"{path}: 0.{state}: expected {total} elements")
                for (name, shape), (b, start) in zip(params, spans, strict=True):
                    begin = starts[b] + start
                    piece = value[begin : begin + shape.numel()].view(shape).float()
                    pieces[state].setdefault(name, []).append(piece)
    return _join_states(model, pieces)
