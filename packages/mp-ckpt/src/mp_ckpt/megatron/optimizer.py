"""A Megatron-LM checkpoint's Adam (and Muon) state and training position, for
import-megatron.

    read_megatron_optimizer(model) -> MegatronOptimizer(states, step, param_groups,
                                                        scheduler, train_state)

`states` maps each state name ("exp_avg", "exp_avg_sq", "momentum_buffer" of
Muon, "param" for an fp32 main parameter that is a copy) to tensors named and laid out like
MegatronModel.tensors (whole, one entry per layer), so that
megatron.logical_from_megatron renames and unfuses them exactly as it does the
weights. The layouts Megatron writes:

- torch_dist, no distributed optimizer: "optimizer.state.<state>.<model key>",
  stacked and chunked like the model key (fp32 copies: "fp32_param"). With
  experts, Megatron chains a dense and an expert optimizer: common_state's
  "optimizer" is then {0: ..., 1: ...}, their parameter groups merge by kind.
  With --optimizer muon (muon.py) the chain holds Muon's optimizer too, whose
  matrices have "optimizer.state.momentum_buffer.<model key>" instead of Adam's
  moments.
- legacy torch, no distributed optimizer: each rank's "optimizer" holds
  torch's state dict, indexed by the parameter's place in the param groups.
  Megatron's groups are the weight-decayed parameters (not a bias, more than
  one dimension) then the others, each in the module's parameter order
  (registration order: in an attention block linear_proj comes before
  linear_qkv). fp32 copies of bf16 / fp16 weights: "fp32_from_fp16_params".
  TP pieces are joined like the weights. With experts "optimizer" is a list:
  the dense parameters' state dict, then the (local) experts'.
- the distributed optimizer (torch_dist's per-bucket flat tensors, or the legacy
  format's distrib_optim.pt beside model_optim_rng.pt, whose param_groups carry the
  step): read by distopt.py, which maps each stage's and TP rank's flat grad
  buffer back to parameters, across buckets and data-parallel ranks.

A layout that cannot be mapped is refused with the file and key that could not be read;
an optimizer other than Adam and Muon, and Muon's state in another layout than
torch_dist without the distributed optimizer, are refused.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mp_ckpt.core.checkpointer import single_process_quiet
from mp_ckpt.megatron.distopt import (
    _BUFFERS,
    STATES,
    read_distrib_optim,
    read_distributed_buckets,
)
from mp_ckpt.megatron.logical import logical_from_megatron, stack_experts
from mp_ckpt.megatron.muon import chained_groups, is_muon_part, refuse_muon_layout
from mp_ckpt.megatron.order import megatron_param_order
from mp_ckpt.megatron.read import (
    _LAYER,
    _LOCAL_EXPERT,
    MegatronModel,
    _RawBytesPlanner,
    _SafeReader,
    join_mamba_parts,
    legacy_name,
    legacy_rank_files,
)
from mp_ckpt.megatron.safe_pickle import safe_load
from mp_ckpt.megatron.tp_layout import join_pieces, mamba_parts

__all__ = ["MegatronOptimizer", "megatron_param_order", "read_megatron_optimizer"]

# Keys of a Megatron parameter group mp's optimizer groups take back.
_GROUP_KEYS = ("lr", "weight_decay", "wd_mult", "lr_mult", "max_lr", "min_lr", "betas", "eps",
               "momentum")  # fmt: skip


@dataclasses.dataclass
class MegatronOptimizer:
    states: dict[str, dict[str, torch.Tensor]]
    step: float
    param_groups: list[dict]
    scheduler: dict
    train_state: dict


def _decayed(name: str, tensor: torch.Tensor) -> bool:
    return not name.endswith("bias") and tensor.dim() > 1


def read_megatron_optimizer(model: MegatronModel) -> MegatronOptimizer:
    refuse_muon_layout(model)
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
    """Megatron's parameter groups as mp orders and names them: by (wd_mult, lr_mult,
    decoupled, muP), a group of the decoupled learning rate (`is_decoupled_lr`) marked
    `decoupled_lr` as mp's are, one muP changes (`mup`, below) marked `mup`."""
    out = []
    for group in groups:
        hyper = {k: group[k] for k in _GROUP_KEYS if group.get(k) is not None}
        hyper.setdefault("wd_mult", 1.0 if group.get("weight_decay", 0.0) else 0.0)
        hyper.setdefault("lr_mult", 1.0)
        if group.get("is_decoupled_lr"):
            hyper["decoupled_lr"] = True
        elif _mup_group(group):
            hyper["mup"] = True
        if "betas" in hyper:
            hyper["betas"] = tuple(hyper["betas"])
        out.append(hyper)
    merged: dict[tuple, dict] = {}
    for group in out:  # the dense and the expert optimizers' groups of the same kind merge
        key = (group["wd_mult"], group["lr_mult"], group.get("decoupled_lr", False),
               group.get("mup", False))  # fmt: skip
        if merged.setdefault(key, group) != group:
            raise ValueError(f"{where}: optimizer param_groups: two groups with wd_mult, "
                             f"lr_mult, decoupled, muP {key} differ: {merged[key]} and "
                             f"{group}")  # fmt: skip
    return [merged[k] for k in sorted(merged)]


def _mup_hidden(name: str, weight: torch.Tensor) -> bool:
    """muP's hidden matrix under Megatron's rule: not embedding-class (the embeddings, the
    output layer) and of two or more dimensions."""
    return weight.dim() >= 2 and "embedding" not in name and name != "output_layer.weight"


def _mup_group(group: dict) -> bool:
    """A group whose learning rate muP changed: Megatron marks a group with its own lr
    schedule `default_config: False`; with lr_mult 1 and not decoupled, only muP's
    overrides (--use-mup) give one (scale_lr_cond, which sets lr_mult, has no flag)."""
    own_schedule = group.get("default_config") is False
    return own_schedule and group.get("lr_mult", 1.0) == 1.0 and not group.get("is_decoupled_lr")


def _step(values, where: str) -> float:
    steps = {float(v) for v in values if v is not None}
    if len(steps) != 1:
        raise ValueError(f"{where}: the Adam step count is {sorted(steps) or 'missing'}")
    return steps.pop()


# --- torch_dist -----------------------------------------------------------------------------


def _load_dist(storage: _SafeReader, keys: list[str], entries) -> tuple[dict, dict]:
    wanted: dict[str, object] = {}
    for key in keys:
        entry = entries[key]
        if isinstance(entry, BytesStorageMetadata):
            wanted[key] = io.BytesIO()
        else:
            wanted[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    planner = _RawBytesPlanner()
    with single_process_quiet():
        dcp.load(wanted, storage_reader=storage, planner=planner, no_dist=True)
    raw = {k: safe_load(v, name=f"{storage.path}:{k}") for k, v in planner.raw.items()}
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
    storage = _SafeReader(directory)
    entries = storage.read_metadata().state_dict_metadata
    common_keys = [k for k in entries if k.startswith("common_state")]
    plain = [k for k in entries if k.startswith("optimizer.state.")]
    distributed = [k for k in entries if k.startswith("optimizer.distributed.")]
    if not plain and not distributed:
        raise ValueError(f"{directory}: no optimizer.state.* nor optimizer.distributed.* keys "
                         "(saved without optimizer state)")  # fmt: skip
    tensors, raw = _load_dist(storage, plain + distributed + common_keys, entries)
    common = _one(raw[common_keys[0]]) if common_keys else safe_load(directory / "common.pt")
    where = f"{directory}"
    states: dict[str, dict[str, torch.Tensor]] = {s: {} for s in (*STATES, "momentum_buffer")}
    if plain:
        for key, value in tensors.items():
            name, _, model_key = key.removeprefix("optimizer.state.").partition(".")
            state = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                     "momentum_buffer": "momentum_buffer",
                     "fp32_param": "param"}.get(name)  # fmt: skip
            if state is None:
                raise ValueError(f"{directory}: {key}: unknown optimizer state {name!r}")
            states[state].update(_unstack(model_key, value))
        states = {s: join_mamba_parts(by_name) for s, by_name in states.items()}
        saved = common.get("optimizer") or {}
        # several optimizers (dense, experts) are saved as {0: state dict, 1: ...}
        chained = [saved[k] for k in sorted(saved)] if saved and all(
            isinstance(k, int) for k in saved) else [saved]  # fmt: skip
        groups, muon_groups, steps = [], [], []
        for part in chained:
            if part.get("param_groups") is None:
                raise ValueError(f"{directory}: common_state: no optimizer.param_groups")
            if is_muon_part(part):  # Muon's groups (its state holds no step)
                muon_groups += part["param_groups"]
                continue
            groups += part["param_groups"]
            step_value = (part.get("state") or {}).get("common_step")
            steps += [step_value] if step_value is not None else [
                g.get("step") for g in part["param_groups"]]  # fmt: skip
        step = _step(steps, f"{where} common_state")
        if bool(muon_groups) != bool(states["momentum_buffer"]):
            raise ValueError(f"{where}: common_state: {len(muon_groups)} Muon parameter groups "
                             f"and {len(states['momentum_buffer'])} momentum buffers")  # fmt: skip
    else:
        muon_groups = []
        states, groups, step = _distributed(model, tensors, raw)
    param_groups = _groups(groups, where)
    if muon_groups:  # mp's order: Muon's groups, then Adam's, one of each kind
        param_groups = chained_groups(_groups(muon_groups, where), param_groups, where)
    return MegatronOptimizer(states, step, param_groups, _scheduler(common, where),
                             _train_state(model, common))  # fmt: skip


def _distributed(model: MegatronModel, tensors: dict, raw: dict):
    directory = model.directory
    states = read_distributed_buckets(model, tensors, raw)
    groups_key = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    saved = _one(raw.get(groups_key))
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not groups:
        raise ValueError(f"{directory}: {groups_key}: no param_groups")
    return states, groups, _step((g.get("step") for g in groups), f"{directory}: {groups_key}")


# --- torch (legacy) -------------------------------------------------------------------------


def _read_torch(model: MegatronModel) -> MegatronOptimizer:
    directory = model.directory
    args, files = legacy_rank_files(directory)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    local_experts = (getattr(args, "num_experts", None) or 0) // ep
    if any((path.parent / "distrib_optim.pt").exists() for path in files.values()):
        if ep > 1:
            raise ValueError(f"{directory}: distrib_optim.pt with expert parallelism "
                             f"(EP {ep}) is not imported")  # fmt: skip
        return _read_torch_distopt(model, {(p, t): f for (p, _, t), f in files.items()})
    swiglu, parts = bool(getattr(model.args, "swiglu", False)), mamba_parts(model.args)
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
                    glob = legacy_name(name, e, local_experts)
                    match = _LAYER.match(glob)
                    if match:
                        glob = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
                    states[state_name][glob] = join_pieces(name, pieces, swiglu, None, parts)
        offset += len(layers)
    where = str(directory)
    return MegatronOptimizer(states, _step(steps, where), _groups(groups, where),
                             _scheduler(first, str(files[(0, 0, 0)])),
                             _train_state(model, first))  # fmt: skip


def _read_torch_distopt(model: MegatronModel, ranks: dict[tuple[int, int], Path]):
    """Legacy files with the distributed optimizer: the Adam state in each folder's
    distrib_optim.pt, the parameter groups (with the step) in model_optim_rng.pt."""
    files = {}
    for key, path in ranks.items():
        files[key] = path.parent / "distrib_optim.pt"
        if not files[key].exists():
            raise ValueError(f"{files[key]}: missing (other ranks have one)")
    steps, groups, first = [], None, None
    for key in sorted(ranks):
        state = safe_load(ranks[key])
        first = first if first is not None else state
        inner = (state.get("optimizer") or {}).get("optimizer") or {}
        rank_groups = inner.get("param_groups")
        if not rank_groups:
            raise ValueError(f"{ranks[key]}: optimizer.optimizer.param_groups: missing")
        steps += [g.get("step") for g in rank_groups]
        groups = groups if groups is not None else rank_groups
    where = str(model.directory)
    return MegatronOptimizer(read_distrib_optim(model, files), _step(steps, where),
                             _groups(groups, where), _scheduler(first, str(ranks[(0, 0)])),
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
    if any(group.get("is_decoupled_lr") for group in inner["param_groups"]):
        raise ValueError(
            f"{path}: optimizer.param_groups hold a decoupled learning rate group (a run "
            "with --decoupled-lr), whose parameters this format does not name: convert a "
            "torch_dist or distributed-optimizer checkpoint of it instead"
        )
    order = megatron_param_order(weights, str(path))
    decayed = [n for n in order if _decayed(n, weights[n])]
    others = [n for n in order if not _decayed(n, weights[n])]
    # muP (Adam): the decayed hidden matrices have a group of their own
    mup = any(_mup_group(group) for group in inner["param_groups"])
    hidden = [n for n in decayed if mup and _mup_hidden(n, weights[n])]
    by_group = []
    for i, group in enumerate(inner["param_groups"]):
        wd = group.get("wd_mult", 1.0 if group.get("weight_decay") else 0.0)
        names = decayed if wd else others
        what = "decayed" if wd else "non-decayed"
        if wd and mup:
            scaled = _mup_group(group)
            names = hidden if scaled else [n for n in decayed if n not in hidden]
            what = "muP hidden matrix" if scaled else "decayed vector-like"
        if len(group["params"]) != len(names):
            raise ValueError(
                f"{path}: optimizer.param_groups[{i}] holds {len(group['params'])} parameters; "
                f"the model has {len(names)} {what} ones"
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


def _check_coverage(model: MegatronModel, states: dict, params: set[str]) -> None:
    """Every parameter has Adam's two moments or (under Muon) a momentum buffer."""
    adam, squares = set(states["exp_avg"]), set(states["exp_avg_sq"])
    muon = set(states.get("momentum_buffer") or {})
    if adam != squares:
        raise ValueError(f"{model.directory}: {sorted(adam ^ squares)[0]} has only one of "
                         "exp_avg and exp_avg_sq")  # fmt: skip
    if adam & muon:
        raise ValueError(f"{model.directory}: {sorted(adam & muon)[0]} has both Adam's "
                         "moments and Muon's momentum_buffer")  # fmt: skip
    missing = sorted(params - adam - muon)
    if missing:
        held = "exp_avg nor momentum_buffer" if muon else "exp_avg"
        raise ValueError(f"{model.directory}: no {held} for {missing[0]}")


def mp_optimizer_state(model: MegatronModel, weights: dict[str, torch.Tensor]):
    """({"optimizer.<state>.<logical key>": tensor}, common entries) as mp's training
    checkpoints hold them; `weights` are mp's logical weights (fp32 copies equal to them
    are not written: the main parameters are the weights). Under Muon a matrix has a
    momentum_buffer, every other parameter Adam's moments."""
    read = read_megatron_optimizer(model)
    params = {k for k in model.tensors if not k.endswith(_BUFFERS)}
    _check_coverage(model, read.states, params)
    tensors: dict[str, torch.Tensor] = {}
    for state, name in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"),
                        ("momentum_buffer", "momentum_buffer"),
                        ("param", "fp32_param")):  # fmt: skip
        held = read.states.get(state)
        if not held:
            continue
        missing = sorted(params - set(held))
        # the parameters another optimizer steps (Muon's beside Adam's) or fp32 copies
        # that are the weights: the weights stand in for them, to unfuse the rest
        by_name = {**{k: model.tensors[k] for k in missing}, **held}
        owned = set(stack_experts(held, str(model.directory)))
        sources: dict[str, str] = {}
        logical, _ = logical_from_megatron(dataclasses.replace(model, tensors=by_name), sources)
        for key, tensor in logical.items():
            if state != "param" and sources[key] not in owned:
                continue
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
