"""The optimizer's state as sharding descriptions, loadable under another layout.

Each state tensor of a main parameter (Adam's exp_avg and exp_avg_sq, SGD's and
Muon's momentum_buffer, and the fp32 main parameter itself when it is a copy of a
bf16 / fp16 parameter) is described like the model parameter it belongs to:
for every piece of the model's sharded_state_dict (a logical tensor such as
linear_qkv.q.weight, a view into a fused parameter) the same view of the
state tensor, under the key "optimizer.<state>.<logical key>".

The distributed optimizer holds a flat range [a, b) of each flattened
parameter. The elements of a model piece that fall in that range are a
contiguous range of the piece's own row-major flattening (pieces are
order-preserving views), so the rank describes them as a flattened range of
the piece's box; the state values are gathered from the shard. Loading under
another data-parallel size reads each rank's new ranges.

Replicas: a plain optimizer's state is the same on every data-parallel rank,
so only dp rank 0 saves (and the model piece's own replica rule applies);
distributed-optimizer shards are disjoint and all saved.

Expert parameters follow the same rules over their own data-parallel group
(expert dp): the model piece of an expert weight names the logical tensor of
all experts and where this rank's experts sit in it, so the optimizer state
saved under one expert-parallel size loads under another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from mp_ckpt import ShardedTensor
from mp_optim.flat_ranges import flat_range_piece, locate, overlap
from mp_optim.muon import Muon
from mp_optim.scheduler import settled

if TYPE_CHECKING:
    from mp_optim.optimizer import MixedPrecisionOptimizer

__all__ = ["load_optimizer_state", "optimizer_sharded_state_dict"]

STATE_NAMES = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer",),
    "lion": ("exp_avg",),
    "muon": ("momentum_buffer",),
}
_Writer = Callable[[torch.Tensor], None]


def optimizer_sharded_state_dict(optimizer: MixedPrecisionOptimizer) -> dict:
    """{"state": {key: ShardedTensor}, "common": hyper-parameters, step, loss scale}."""
    init_state(optimizer)
    state = {key: piece for key, piece, _ in _described_states(optimizer)}
    return {"state": state, "common": _common(optimizer)}


def load_optimizer_state(optimizer: MixedPrecisionOptimizer, saved: dict) -> None:
    """Loads `saved`: optimizer_sharded_state_dict's structure, its pieces filled with the
    checkpoint's values (taken for this rank's layout, e.g. with ShardedTensor.read_from)."""
    init_state(optimizer)
    pieces = saved["state"]
    missing = []
    with torch.no_grad():
        for key, _, write in _described_states(optimizer):
            if key not in pieces:
                missing.append(key)
                continue
            write(pieces[key].data)
        if missing:
            raise KeyError(f"optimizer state misses {len(missing)} tensors: {missing[:5]}")
        common = saved["common"]
        groups = optimizer.optimizer.param_groups
        if len(common["param_groups"]) != len(groups):
            raise ValueError(
                f"the checkpoint has {len(common['param_groups'])} parameter groups "
                f"({_kinds(common['param_groups'])}), this optimizer {len(groups)} "
                f"({_kinds(groups)})"
            )
        for group, hyper in zip(groups, common["param_groups"], strict=True):
            group.update(_checked_hyper(group, hyper, optimizer.config))
        for main in _main_params(optimizer):
            if "step" in optimizer.optimizer.state[main]:
                optimizer.optimizer.state[main]["step"].fill_(float(common["step"]))
        if optimizer.grad_scaler is not None and common["grad_scaler"] is not None:
            optimizer.grad_scaler.load_state_dict(common["grad_scaler"])
        for shards in optimizer.shards.values():
            for shard in shards:
                if not shard.aliased:
                    shard.model_view.copy_(shard.main_param)
    optimizer.sync_model_params(force_sync=True)


_SCHEDULE_ENDS = ("max_lr", "min_lr")


def _group_kind(group: dict) -> tuple:
    return (group.get("wd_mult", 1.0), group.get("lr_mult", 1.0),
            bool(group.get("decoupled_lr", False)), bool(group.get("mup", False)))  # fmt: skip


def _kinds(groups: list[dict]) -> str:
    """The groups' (wd_mult, lr_mult, decoupled, muP) for an error message."""
    return ", ".join(
        f"wd_mult {w:g} lr_mult {m:g}{' decoupled lr' if d else ''}{' muP' if u else ''}"
        for w, m, d, u in map(_group_kind, groups)
    )


def _checked_hyper(group: dict, hyper: dict, config) -> dict:
    """The checkpoint's hyper-parameters of `group`, after checking that they belong to
    a group of the same kind. The ends of the lr schedule: a group without its own
    follows the scheduler's (which settles them with the checkpoint's); a decoupled or
    muP group's are settled as the scheduler settles its own: the command line's with
    override_opt_param_scheduler, the checkpoint's with
    use_checkpoint_opt_param_scheduler, else they must agree."""
    if _group_kind(group) != _group_kind(hyper):
        raise ValueError(
            f"the checkpoint's parameter group ({_kinds([hyper])}) stands where this "
            f"optimizer has ({_kinds([group])}): the checkpoint was saved with other "
            "weight-decay rules or another --decoupled-lr or muP (--use-mup) setting"
        )
    hyper = dict(hyper)
    for key in _SCHEDULE_ENDS:
        if key not in group:  # the group follows the scheduler's own ends
            hyper.pop(key, None)  # (a checkpoint imported from Megatron-LM carries them)
            continue
        if key not in hyper:
            continue
        if group.get("decoupled_lr"):
            kind = "decoupled learning rate group"
            flag = "decoupled_lr" if key == "max_lr" else "decoupled_min_lr"
        else:
            kind = "muP group"
            flag = ("lr" if key == "max_lr" else "min_lr") + " and the muP width multiplier"
        hyper[key] = settled(
            group[key], hyper[key], override=config.override_opt_param_scheduler,
            use_checkpoint=config.use_checkpoint_opt_param_scheduler,
            mismatch=f"the checkpoint's {kind} has {key}={hyper[key]}, "
            f"this run {group[key]} ({flag}): pass --override-opt-param-scheduler to use "
            "this run's or --use-checkpoint-opt-param-scheduler to keep the checkpoint's",
        )  # fmt: skip
    return hyper


def init_state(optimizer: MixedPrecisionOptimizer) -> None:
    """Creates the state a first step would create (zeros), so that it can be loaded into."""
    for main in _main_params(optimizer):
        kind = _kind(optimizer, main)
        names = STATE_NAMES[kind]
        state = optimizer.optimizer.state[main]
        if all(name in state for name in names):
            continue
        dtypes = optimizer.config.moment_dtypes if kind == "adam" else {}
        for name in names:
            state[name] = torch.zeros_like(main, dtype=dtypes.get(name, main.dtype),
                                           memory_format=torch.preserve_format)  # fmt: skip
        if kind == "adam":
            state["step"] = torch.tensor(0.0, device=main.device)


def _kind(optimizer: MixedPrecisionOptimizer, main: torch.Tensor) -> str:
    """Which optimizer steps `main`: adam, sgd or lion, and under muon muon or its scalar
    optimizer (adam or lion)."""
    config = optimizer.config
    if config.optimizer != "muon":
        return config.optimizer
    return (
        "muon"
        if isinstance(optimizer.optimizer.owner(main), Muon)
        else (config.muon_scalar_optimizer)
    )


def _main_params(optimizer: MixedPrecisionOptimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.optimizer.param_groups for p in group["params"]]


def _common(optimizer: MixedPrecisionOptimizer) -> dict:
    steps = [
        float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s
    ]  # fmt: skip
    return {
        "param_groups": [
            {k: v for k, v in group.items() if k != "params"}
            for group in optimizer.optimizer.param_groups
        ],
        "step": max(steps, default=0.0),
        "grad_scaler": optimizer.grad_scaler.state_dict() if optimizer.grad_scaler else None,
    }


def _described_states(
    optimizer: MixedPrecisionOptimizer,
) -> Iterator[tuple[str, ShardedTensor, _Writer]]:
    """(key, piece, writer) for every state tensor piece of this rank."""
    flat = optimizer.distributed or optimizer.fully_sharded  # each rank holds flat ranges
    for chunk in optimizer.model_chunks:
        for piece, param, offset in _model_pieces(chunk, optimizer.shards):
            for shard in optimizer.shards[param]:
                dp = optimizer.expert_dp_group if shard.expert_parallel else optimizer.dp_group
                names = STATE_NAMES[_kind(optimizer, shard.main_param)]
                tensors = {n: optimizer.optimizer.state[shard.main_param][n] for n in names}
                if shard.keeps_copy:
                    tensors["fp32_param"] = shard.main_param
                part = None
                if flat:
                    lo = shard.start
                    part = overlap(piece, param.numel(), offset, lo, lo + shard.main_param.numel())
                    if part is None:
                        continue
                # the other distributed-optimizer instances hold copies of this range
                copies = optimizer.dp_replica_groups[shard.expert_parallel]
                described = piece if copies is None else dataclasses.replace(
                    piece, replica_id=piece.replica_id * copies.size + copies.rank)  # fmt: skip
                for name, tensor in tensors.items():
                    key = f"optimizer.{name}.{piece.key}"
                    if part is not None:
                        yield (key, *flat_range_piece(key, described, part, tensor))
                    else:
                        view = tensor.as_strided(
                            piece.data.size(), piece.data.stride(), tensor.storage_offset() + offset
                        )
                        # layer-wise: the owner alone holds (and saves) the state
                        replica = piece.replica_id * dp.size + (
                            0 if optimizer.layer_wise else dp.rank
                        )
                        yield (
                            key,
                            ShardedTensor(
                                key, view, piece.global_shape, piece.global_offset, replica
                            ),
                            view.copy_,
                        )


def _model_pieces(chunk, owned: dict):
    """(piece, parameter, element offset of the piece's view in the parameter) for the
    chunk's parameters among `owned`'s keys."""
    if hasattr(chunk, "piece_layout"):  # FSDP: the pieces as the whole parameters give them
        # (its parameters listed only now: piece_layout shards gathered ones again first)
        for _, piece, param, offset in chunk.piece_layout():
            if param is not None and param in owned:
                yield piece, param, offset
        return
    params = [p for p in chunk.module.parameters() if p in owned]
    module = chunk.module
    if hasattr(module, "sharded_state_dict"):
        pieces = chunk.sharded_state_dict()
    else:  # a plain module: every parameter whole, by its name
        pieces = {
            name: ShardedTensor(name, p.data, tuple(p.shape), (0,) * p.dim())
            for name, p in module.named_parameters()
        }
    yield from locate(pieces.values(), params)
