"""A Megatron-LM checkpoint's Adam state and training position, for import-megatron.

    read_megatron_optimizer(model) -> MegatronOptimizer(states, step, param_groups,
                                                        scheduler, train_state)

`states` maps each state name ("exp_avg", "exp_avg_sq", "param" for an fp32
main parameter that is a copy) to tensors named and laid out like
MegatronModel.tensors (whole, one entry per layer), so that
megatron.logical_from_megatron renames and unfuses them exactly as it does the
weights. The three layouts Megatron writes:

- torch_dist, no distributed optimizer: "optimizer.state.<state>.<model key>",
  stacked and chunked like the model key (fp32 copies: "fp32_param"). With
  experts, Megatron chains a dense and an expert optimizer: common_state's
  "optimizer" is then {0: ..., 1: ...}, their parameter groups merge by kind.
- legacy torch, no distributed optimizer: each rank's "optimizer" holds
  torch's state dict, indexed by the parameter's place in the param groups.
  Megatron's groups are the weight-decayed parameters (not a bias, more than
  one dimension) then the others, each in the module's parameter order
  (registration order: in an attention block linear_proj comes before
  linear_qkv). fp32 copies of bf16 / fp16 weights: "fp32_from_fp16_params".
  TP pieces are joined like the weights. With experts "optimizer" is a list:
  the dense parameters' state dict, then the (local) experts'.
- torch_dist, distributed optimizer: per data-parallel group one flat buffer
  per state ("optimizer.distributed.dp_group_idx_<g>.gbuf_idx_0.dtype_(...)
  .bucket_idx_0.<state>"): the rank's TP-local parameters in reverse module
  order, each starting at a multiple of 64 elements. The map is rebuilt from
  the local shapes.

Anything else (several buckets or buffers, a distributed optimizer under
pipeline parallelism, distrib_optim.pt beside legacy files) is refused with
the file and key that could not be read.
"""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mp_ckpt.checkpointer import single_process_quiet
from mp_ckpt.megatron_pickle import safe_load
from mp_ckpt.megatron_read import (
    _COLUMN,
    _LAYER,
    _LOCAL_EXPERT,
    _ROW,
    MegatronModel,
    _join,
    _RawBytesPlanner,
    _SafeReader,
    global_expert_name,
    legacy_rank_files,
)

__all__ = ["MegatronOptimizer", "megatron_param_order", "read_megatron_optimizer"]

STATES = ("exp_avg", "exp_avg_sq", "param")
_ALIGN = 64  # the distributed optimizer starts every parameter at a multiple of 64 elements
# Order of a layer's parameters in Megatron's modules (registration order).
_LAYER_ORDER = (
    "input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
    "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
    "mlp.linear_fc1.", "mlp.linear_fc2.", "mlp.router.", "mlp.experts.",
    "mlp.shared_experts.gate_", "mlp.shared_experts.linear_fc1.",
    "mlp.shared_experts.linear_fc2.",
)  # fmt: skip
# An expert's parameters, in the order of its number then its module (legacy names).
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_SUFFIX_ORDER = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")
_GLOBAL_ORDER = {
    "embedding.word_embeddings.weight": 0, "embedding.position_embeddings.weight": 1,
    "decoder.final_layernorm.weight": 3, "decoder.final_layernorm.bias": 4,
    "output_layer.weight": 5,
}  # fmt: skip
# torch_dist names the local spec's norms as TE's fused ones; the modules are the norms.
_LOCAL_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
# Model tensors that are buffers, not parameters: no optimizer state.
_BUFFERS = ("mlp.router.expert_bias",)
# Keys of a Megatron parameter group mp's optimizer groups take back.
_GROUP_KEYS = ("lr", "weight_decay", "wd_mult", "lr_mult", "max_lr", "min_lr", "betas", "eps")


@dataclasses.dataclass
class MegatronOptimizer:
    states: dict[str, dict[str, torch.Tensor]]
    step: float
    param_groups: list[dict]
    scheduler: dict
    train_state: dict


def _sort_key(name: str, where: str) -> tuple:
    match = _LAYER.match(name)
    if match is None:
        if name not in _GLOBAL_ORDER:
            raise ValueError(f"{where}: {name}: unknown place in Megatron's parameter order")
        return (_GLOBAL_ORDER[name] if _GLOBAL_ORDER[name] < 2 else _GLOBAL_ORDER[name] + 1000,)
    rest = match.group(2)
    expert = _EXPERT.match(rest)
    if expert:
        position = _LAYER_ORDER.index("mlp.experts.")
        module = 0 if expert.group(2) == "linear_fc1" else 1
        suffix = _SUFFIX_ORDER.index(expert.group(3))
        return (2, int(match.group(1)), position, int(expert.group(1)), module, suffix)
    if rest == "mlp.shared_experts.gate_weight":
        return (2, int(match.group(1)), _LAYER_ORDER.index("mlp.shared_experts.gate_"), 0)
    for i, prefix in enumerate(_LAYER_ORDER):
        if rest.startswith(prefix) and rest[len(prefix) :] in _SUFFIX_ORDER:
            return (2, int(match.group(1)), i, _SUFFIX_ORDER.index(rest[len(prefix) :]))
    raise ValueError(f"{where}: {name}: unknown place in Megatron's parameter order")


def megatron_param_order(names, where: str = "checkpoint") -> list[str]:
    """The names in Megatron's module (named_parameters) order."""
    return sorted(names, key=lambda n: _sort_key(n, where))


def _decayed(name: str, tensor: torch.Tensor) -> bool:
    return not name.endswith("bias") and tensor.dim() > 1


def read_megatron_optimizer(model: MegatronModel) -> MegatronOptimizer:
    if model.format == "torch_dist":
        return _read_torch_dist(model)
    return _read_torch(model)


def _scheduler(state: dict, where: str) -> dict:
    scheduler = state.get("opt_param_scheduler") or state.get("lr_scheduler")
    if not isinstance(scheduler, dict):
        raise ValueError(f"{where}: no opt_param_scheduler (the learning-rate schedule)")
    return dict(scheduler)


def _train_state(model: MegatronModel, common: dict) -> dict:
    args = model.args
    return {
        "iteration": model.iteration,
        "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
        "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
        "floating_point_operations_so_far": float(
            common.get("num_floating_point_operations_so_far") or 0.0
        ),
    }


def _groups(groups: list[dict], where: str) -> list[dict]:
    """Megatron's parameter groups as mp orders and names them: by (wd_mult, lr_mult)."""
    out = []
    for group in groups:
        hyper = {k: group[k] for k in _GROUP_KEYS if group.get(k) is not None}
        hyper.setdefault("wd_mult", 1.0 if group.get("weight_decay", 0.0) else 0.0)
        hyper.setdefault("lr_mult", 1.0)
        if "betas" in hyper:
            hyper["betas"] = tuple(hyper["betas"])
        out.append(hyper)
    merged: dict[tuple, dict] = {}
    for group in out:  # the dense and the expert optimizers' groups of the same kind merge
        key = (group["wd_mult"], group["lr_mult"])
        if merged.setdefault(key, group) != group:
            raise ValueError(f"{where}: optimizer param_groups: two groups with wd_mult, "
                             f"lr_mult {key} differ: {merged[key]} and {group}")  # fmt: skip
    return [merged[k] for k in sorted(merged)]


def _step(values, where: str) -> float:
    steps = {float(v) for v in values if v is not None}
    if len(steps) != 1:
        raise ValueError(f"{where}: the Adam step count is {sorted(steps) or 'missing'}")
    return steps.pop()


# --- torch_dist -----------------------------------------------------------------------------


def _load_dist(directory: Path, keys: list[str], entries) -> tuple[dict, dict]:
    wanted: dict[str, object] = {}
    for key in keys:
        entry = entries[key]
        if isinstance(entry, BytesStorageMetadata):
            wanted[key] = io.BytesIO()
        else:
            wanted[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    planner = _RawBytesPlanner()
    with single_process_quiet():
        dcp.load(wanted, storage_reader=_SafeReader(directory), planner=planner, no_dist=True)
    raw = {k: safe_load(v, name=f"{directory}:{k}") for k, v in planner.raw.items()}
    return {k: v for k, v in wanted.items() if isinstance(v, torch.Tensor)}, raw


def _unstack(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    rest = key.removeprefix("decoder.layers.")
    if rest != key and not _LAYER.match(key):
        return {f"decoder.layers.{i}.{rest}": t.contiguous() for i, t in enumerate(value.unbind(0))}
    return {key: value}


def _one(value):
    return value[0] if isinstance(value, list) and value else value


def _read_torch_dist(model: MegatronModel) -> MegatronOptimizer:
    directory = model.directory
    entries = _SafeReader(directory).read_metadata().state_dict_metadata
    common_keys = [k for k in entries if k.startswith("common_state")]
    plain = [k for k in entries if k.startswith("optimizer.state.")]
    distributed = [k for k in entries if k.startswith("optimizer.distributed.")]
    if not plain and not distributed:
        raise ValueError(f"{directory}: no optimizer.state.* nor optimizer.distributed.* keys "
                         "(saved without optimizer state)")  # fmt: skip
    tensors, raw = _load_dist(directory, plain + distributed + common_keys, entries)
    common = _one(raw[common_keys[0]]) if common_keys else safe_load(directory / "common.pt")
    where = f"{directory}"
    states: dict[str, dict[str, torch.Tensor]] = {s: {} for s in STATES}
    if plain:
        for key, value in tensors.items():
            name, _, model_key = key.removeprefix("optimizer.state.").partition(".")
            state = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                     "fp32_param": "param"}.get(name)  # fmt: skip
            if state is None:
                raise ValueError(f"{directory}: {key}: unknown optimizer state {name!r}")
            states[state].update(_unstack(model_key, value))
        saved = common.get("optimizer") or {}
        # several optimizers (dense, experts) are saved as {0: state dict, 1: ...}
        chained = [saved[k] for k in sorted(saved)] if saved and all(
            isinstance(k, int) for k in saved) else [saved]  # fmt: skip
        groups, steps = [], []
        for part in chained:
            if part.get("param_groups") is None:
                raise ValueError(f"{directory}: common_state: no optimizer.param_groups")
            groups += part["param_groups"]
            step_value = (part.get("state") or {}).get("common_step")
            steps += [step_value] if step_value is not None else [
                g.get("step") for g in part["param_groups"]]  # fmt: skip
        step = _step(steps, f"{where} common_state")
    else:
        states, groups, step = _distributed(model, tensors, raw, entries)
    return MegatronOptimizer(states, step, _groups(groups, where), _scheduler(common, where),
                             _train_state(model, common))  # fmt: skip


def _tp_piece(name: str, tensor: torch.Tensor, rank: int, size: int, swiglu: bool):
    """The TP rank's piece of a whole Megatron tensor (the inverse of megatron_read._join)."""
    if size == 1:
        return tensor
    if swiglu and re.search(r"linear_fc1\.(weight|bias)$", name):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
    if _COLUMN.search(name) or name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return tensor.chunk(size, dim=0)[rank]
    if _ROW.search(name):
        return tensor.chunk(size, dim=1)[rank]
    return tensor


def _distributed(model: MegatronModel, tensors: dict, raw: dict, entries):
    directory, args = model.directory, model.args
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    flat = re.compile(
        r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.(dtype_.*)\.bucket_idx_(\d+)"
        r"\.(param|exp_avg|exp_avg_sq)$"
    )
    buffers: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = flat.match(key)
        if match is None:
            continue
        if match.group(2) != "0" or match.group(4) != "0":
            raise ValueError(f"{directory}: {key}: several grad buffers or buckets are not "
                             "imported (their padding is not recorded)")  # fmt: skip
        buffers.setdefault(int(match.group(1)), {})[match.group(5)] = value
    if pp != 1 or sorted(buffers) != list(range(tp)):
        raise ValueError(
            f"{directory}: optimizer.distributed.dp_group_idx_*: {len(buffers)} groups for TP "
            f"{tp} x PP {pp}: only TP-only layouts (one group per TP rank) are imported"
        )
    local_spec = getattr(args, "transformer_impl", "local") == "local"
    swiglu = bool(getattr(args, "swiglu", False))
    names = {}
    for name in model.tensors:
        match = _LAYER.match(name)
        if match and local_spec and match.group(2) in _LOCAL_NORMS:
            names[f"decoder.layers.{match.group(1)}.{_LOCAL_NORMS[match.group(2)]}"] = name
        else:
            names[name] = name
    untied = bool(getattr(args, "untie_embeddings_and_output_weights", False))
    order = [n for n in megatron_param_order(names, str(directory))
             if untied or n != "output_layer.weight"]  # fmt: skip
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {s: {} for s in STATES}
    for rank in range(tp):
        where = f"{directory}: optimizer.distributed.dp_group_idx_{rank}"
        offset, spans = 0, {}
        for name in reversed(order):
            local = _tp_piece(name, model.tensors[names[name]], rank, tp, swiglu)
            offset = -(-offset // _ALIGN) * _ALIGN
            spans[name] = (offset, local.shape)
            offset += local.numel()
        for state in STATES:
            buffer = buffers[rank].get(state)
            if buffer is None:
                raise ValueError(f"{where}: no {state} buffer")
            if buffer.numel() != offset:
                raise ValueError(f"{where}: {state} holds {buffer.numel()} elements; the model's "
                                 f"TP-local parameters packed at {_ALIGN}-element offsets "
                                 f"end at {offset}")  # fmt: skip
            for name, (start, shape) in spans.items():
                piece = buffer[start : start + shape.numel()].view(shape)
                pieces[state].setdefault(names[name], []).append(piece)
    states = {s: {n: _join(n, p, swiglu).contiguous() for n, p in by_name.items()}
              for s, by_name in pieces.items()}  # fmt: skip
    groups_key = [k for k in raw if k.startswith("optimizer.distributed.dp_group_idx_0.optimizer")]
    if not groups_key:
        raise ValueError(f"{directory}: no optimizer.distributed.dp_group_idx_0.optimizer "
                         "(the parameter groups)")  # fmt: skip
    saved = _one(raw[groups_key[0]])
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not groups:
        raise ValueError(f"{directory}: {groups_key[0]}: no param_groups")
    step = _step((g.get("step") for g in groups), f"{directory}: {groups_key[0]}")
    return states, groups, step


# --- torch (legacy) -------------------------------------------------------------------------


def _read_torch(model: MegatronModel) -> MegatronOptimizer:
    directory = model.directory
    args, files = legacy_rank_files(directory)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    local_experts = (getattr(args, "num_experts", None) or 0) // ep
    swiglu = bool(getattr(model.args, "swiglu", False))
    states: dict[str, dict[str, torch.Tensor]] = {s: {} for s in STATES}
    steps, groups, first = [], [], None
    offset = 0
    for stage in range(pp):
        layers: set[int] = set()
        for e in range(ep):
            per_rank: list[dict[str, dict[str, torch.Tensor]]] = []
            for t in range(tp):
                path = files[(stage, e, t)]
                if (path.parent / "distrib_optim.pt").exists():
                    raise ValueError(f"{path.parent / 'distrib_optim.pt'}: the legacy distributed "
                                     "optimizer's state is not imported")  # fmt: skip
                state = safe_load(path)
                first = first if first is not None else state
                local, rank_steps, rank_groups = _rank_state(state, path)
                steps += rank_steps
                groups = groups or rank_groups
                per_rank.append(local)
            layers |= {int(m.group(1)) for n in per_rank[0]["exp_avg"] if (m := _LAYER.match(n))}
            for state_name in STATES:
                for name in per_rank[0][state_name]:
                    if e > 0 and not _LOCAL_EXPERT.match(name):
                        continue  # every EP rank holds the same copy of what is not an expert
                    pieces = [r[state_name][name] for r in per_rank]
                    glob = global_expert_name(name, e, local_experts)
                    match = _LAYER.match(glob)
                    if match:
                        glob = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
                    states[state_name][glob] = _join(name, pieces, swiglu)
        offset += len(layers)
    where = str(directory)
    return MegatronOptimizer(states, _step(steps, where), _groups(groups, where),
                             _scheduler(first, str(files[(0, 0, 0)])),
                             _train_state(model, first))  # fmt: skip


def _rank_state(state: dict, path: Path):
    """({state: {local name: tensor}}, steps, param groups) of one rank's file. With experts
    Megatron chains two optimizers, saved as a list: the dense parameters', then the
    experts'."""
    optimizer = state.get("optimizer")
    parts = optimizer if isinstance(optimizer, list) else [optimizer]
    if not all(isinstance(p, dict) and "param_groups" in p for p in parts):
        raise ValueError(f"{path}: optimizer: no torch optimizer state (saved without it?)")
    weights = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)
               and "_extra_state" not in k and not k.endswith(_BUFFERS)}  # fmt: skip
    experts = {k for k in weights if _LOCAL_EXPERT.match(k)}
    if len(parts) == 2:
        kinds = [{k: v for k, v in weights.items() if k not in experts},
                 {k: v for k, v in weights.items() if k in experts}]  # fmt: skip
    elif len(parts) == 1:
        kinds = [weights]
    else:
        raise ValueError(f"{path}: optimizer: {len(parts)} chained optimizers; mp reads one, "
                         "or the dense and the expert ones")  # fmt: skip
    local: dict[str, dict[str, torch.Tensor]] = {s: {} for s in STATES}
    steps, groups = [], []
    for part, kind in zip(parts, kinds, strict=True):
        part_steps, part_groups = _torch_optimizer_state(part, kind, path, local)
        steps += part_steps
        groups += part_groups
    return local, steps, groups


def _torch_optimizer_state(optimizer: dict, weights: dict, path: Path, local: dict):
    """Reads one torch optimizer's state of `weights` into `local`: (steps, param groups)."""
    inner = optimizer.get("optimizer", optimizer)  # mixed precision wraps torch's state dict
    if "state" not in inner or "param_groups" not in inner:
        raise ValueError(f"{path}: optimizer: no state / param_groups")
    decayed = [n for n in megatron_param_order(weights, str(path)) if _decayed(n, weights[n])]
    others = [n for n in megatron_param_order(weights, str(path)) if not _decayed(n, weights[n])]
    by_group = []
    for i, group in enumerate(inner["param_groups"]):
        wd = group.get("wd_mult", 1.0 if group.get("weight_decay") else 0.0)
        names = decayed if wd else others
        if len(group["params"]) != len(names):
            raise ValueError(
                f"{path}: optimizer.param_groups[{i}] holds {len(group['params'])} parameters; "
                f"the model has {len(names)} {'decayed' if wd else 'non-decayed'} ones"
            )
        by_group.append((group["params"], names))
    if sum(len(p) for p, _ in by_group) != len(weights):
        raise ValueError(f"{path}: optimizer.param_groups do not cover the model's "
                         f"{len(weights)} parameters")  # fmt: skip
    fp32 = optimizer.get("fp32_from_fp16_params")
    steps = []
    for g, (indices, names) in enumerate(by_group):
        for j, (index, name) in enumerate(zip(indices, names, strict=True)):
            entry = inner["state"].get(index)
            if entry is None:
                raise ValueError(f"{path}: optimizer.state.{index} ({name}) is missing")
            for key in ("exp_avg", "exp_avg_sq"):
                value = entry.get(key)
                if value is None or value.shape != weights[name].shape:
                    raise ValueError(f"{path}: optimizer.state.{index}.{key}: expected "
                                     f"{name}'s shape {tuple(weights[name].shape)}")  # fmt: skip
                local[key][name] = value.float()
            steps.append(entry.get("step"))
            if fp32 is not None:
                local["param"][name] = fp32[g][j].float()
    return steps, inner["param_groups"]


# --- mp's form ------------------------------------------------------------------------------


def mp_optimizer_state(model: MegatronModel, weights: dict[str, torch.Tensor]):
    """({"optimizer.<state>.<logical key>": tensor}, common entries) as mp's training
    checkpoints hold them; `weights` are mp's logical weights (fp32 copies equal to them
    are not written: the main parameters are the weights)."""
    from mp_ckpt.megatron import logical_from_megatron

    read = read_megatron_optimizer(model)
    tensors: dict[str, torch.Tensor] = {}
    for state, name in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"),
                        ("param", "fp32_param")):  # fmt: skip
        by_name = read.states[state]
        if not by_name:
            continue
        missing = sorted(k for k in set(model.tensors) - set(by_name) if not k.endswith(_BUFFERS))
        if missing and state != "param":
            raise ValueError(f"{model.directory}: no {state} for {missing[0]}")
        if missing:  # some fp32 copies only: the others are the weights
            by_name = {**{k: model.tensors[k] for k in missing}, **by_name}
        logical, _ = logical_from_megatron(dataclasses.replace(model, tensors=by_name))
        for key, tensor in logical.items():
            if name == "fp32_param" and torch.equal(tensor, weights[key].to(tensor.dtype)):
                continue
            tensors[f"optimizer.{name}.{key}"] = tensor.float().contiguous()
    train = {"iteration": read.train_state["iteration"], "consumed_train_samples": 0,
             "consumed_valid_samples": 0, "skipped_iterations": 0, "nan_iterations": 0,
             "floating_point_operations_so_far": 0.0} | read.train_state  # fmt: skip
    common = {
        "iteration": model.iteration,
        "train_state": train,
        "scheduler": read.scheduler,
        "optimizer": {"param_groups": read.param_groups, "step": read.step, "grad_scaler": None},
    }
    return tensors, common
