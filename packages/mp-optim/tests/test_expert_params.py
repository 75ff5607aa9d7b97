"""Expert-parallel parameters in DDP, the optimizer and the gradient norm.

A toy mixture-of-experts model splits its expert weight, one logical tensor
[E*R, D] of E experts with R rows each, over the expert-parallel ranks; as
with the all-to-all of a real MoE layer, every expert sees the tokens of
every rank of its ep group (here: all tokens go to all experts). On 2 and 4
gloo ranks and every expert-parallel size, against one process on the
global batch:

- the reduced gradients of dense and expert parameters (plain and
  overlapped reductions, average_in_collective, micro-batches);
- training with SGD, clipping and the count of zeros, plain and with the
  distributed optimizer: the gradient norm, the zeros and the parameters;
- the optimizer state saved at one expert-parallel size and loaded at another.
"""

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import ShardedTensor, assemble, check_tiling
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import ParallelConfig, RankGroup
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

E, R, D, H, OUT, BATCH = 4, 3, 6, 5, 2, 8
SINGLE = RankGroup("single", (0,), 0, None)
LAYOUTS = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]  # (world size, expert-parallel size)


class _GatherRows(torch.autograd.Function):
    """[n, ...] on each ep rank -> [ep * n, ...] everywhere; the backward sums the
    gradients of every rank's copy and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, group: RankGroup):
        ctx.group = group
        out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group.group)
        return grad.chunk(ctx.group.size)[ctx.group.rank], None


def gather_rows(x, group: RankGroup):
    return x if group.size == 1 else _GatherRows.apply(x, group)


class ToyMoE(torch.nn.Module):
    """y = tanh(every expert on every token of the ep group) B^T, the tokens tanh(x A^T).

    This rank holds E/ep experts: rows [ep_rank * E*R/ep, ...) of the expert weight
    and of `spare`, an expert parameter no forward uses (its gradient is zero).
    """

    def __init__(self, ep: RankGroup):
        super().__init__()
        torch.manual_seed(0)
        rows = E * R // ep.size
        mine = slice(ep.rank * rows, (ep.rank + 1) * rows)
        self.ep, self.row_offset = ep, ep.rank * rows
        self.unused = torch.nn.Parameter(torch.randn(3))  # dense, zero gradient
        self.spare = torch.nn.Parameter(torch.randn(E * R, 2)[mine].clone())
        self.inp = torch.nn.Parameter(torch.randn(D, H) * 0.5)
        self.experts = torch.nn.Parameter((torch.randn(E * R, D) * 0.5)[mine].clone())
        self.out = torch.nn.Parameter(torch.randn(OUT, E * R) * 0.5)
        self.spare.expert_parallel = self.experts.expert_parallel = True

    def forward(self, x):  # x: [n, H] this rank's tokens
        tokens = gather_rows(torch.tanh(x @ self.inp.t()), self.ep)  # [ep * n, D]
        z = tokens @ self.experts.t()  # [ep * n, E*R/ep]: this rank's experts, all tokens
        z = gather_rows(z.t(), self.ep).t()  # [ep * n, E*R]: every expert
        return torch.tanh(z.chunk(self.ep.size)[self.ep.rank]) @ self.out.t()  # [n, O]

    def sharded_state_dict(self, prefix=""):
        pieces = {}
        for name, param in self.named_parameters():
            offset = [0] * param.dim()
            shape = list(param.shape)
            if getattr(param, "expert_parallel", False):
                offset[0], shape[0] = self.row_offset, E * R
            key = prefix + name
            pieces[key] = ShardedTensor(key, param.data, tuple(shape), tuple(offset))
        return pieces

    def logical(self) -> dict[str, tuple[torch.Tensor, slice]]:
        """name -> (this rank's tensor, its rows in the logical tensor)."""
        return {
            name: (p, slice(self.row_offset, self.row_offset + p.shape[0]))
            if getattr(p, "expert_parallel", False)
            else (p, slice(None))
            for name, p in self.named_parameters()
        }


def global_batch(step: int):
    generator = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, H, generator=generator), torch.randn(BATCH, OUT, generator=generator)


def my_part(tensors, dp: RankGroup):
    return [t.chunk(dp.size)[dp.rank] for t in tensors]


def reference_grads(step: int) -> dict[str, torch.Tensor]:
    """The gradient of the global batch's mean loss, in one process."""
    model = ToyMoE(SINGLE)
    x, y = global_batch(step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in
            model.named_parameters()}  # fmt: skip


def groups(state):
    return {"dp_group": state.dp_cp, "expert_dp_group": state.expert_dp}


def start(ep: int):
    torch.set_num_threads(1)
    return mp_state.initialize(ParallelConfig(expert_model_parallel_size=ep))


def stop():
    mp_state.destroy()
    dist.barrier()


# --- reduced gradients -----------------------------------------------------------------------

GRAD_CASES = [(False, False, 1), (True, False, 2), (False, True, 1), (True, True, 2)]


def grads_body(ep: int):
    state = start(ep)
    want = reference_grads(0)
    errors, launched = {}, {}
    for overlap, average, micro in GRAD_CASES:
        config = OptimizerConfig(
            lr=0.1, overlap_grad_reduce=overlap, average_in_collective=average, bucket_size=8
        )
        model = DistributedDataParallel(config, ToyMoE(state.ep), **groups(state))
        parts = list(
            zip(*(t.chunk(micro) for t in my_part(global_batch(0), state.dp_cp)), strict=True)
        )
        for i, (x, y) in enumerate(parts):
            last = i == len(parts) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                (torch.nn.functional.mse_loss(model(x), y) / micro).backward()
        launched[(overlap, average, micro)] = sum(
            b.buffer.expert_parallel for b in model._grad_work
        )  # expert buckets started during the backward
        model.finish_grad_sync()
        for name, (param, rows) in model.module.logical().items():
            error = (param.main_grad - want[name][rows]).abs().max()
            errors[(overlap, average, micro, name)] = float(error)
    stop()
    return errors, launched


@pytest.mark.parametrize("world,ep", LAYOUTS, ids=[f"w{w}-ep{e}" for w, e in LAYOUTS])
def test_reduced_gradients_are_those_of_the_global_batch(world, ep):
    for rank, (errors, launched) in enumerate(run_on_ranks(grads_body, world, ep, timeout=90)):
        for case, error in errors.items():
            assert error < 1e-6, f"rank {rank} (world {world}, ep {ep}) {case}: off by {error:.2e}"
        # Expert buckets start as soon as they are full, whatever the dense ones wait for
        # (the dense `unused` parameter never gets a gradient during the backward).
        assert all(launched[c] >= 1 for c in launched if c[0]), launched


def test_an_expert_parameter_needs_the_expert_group():
    with pytest.raises(ValueError, match=r"spare is an expert-parallel parameter.*expert_dp_group"):
        DistributedDataParallel(OptimizerConfig(lr=0.1), ToyMoE(SINGLE), dp_group=SINGLE)


def test_the_optimizer_needs_the_expert_model_parallel_group():
    model = DistributedDataParallel(
        OptimizerConfig(lr=0.1), ToyMoE(SINGLE), dp_group=SINGLE, expert_dp_group=SINGLE
    )
    with pytest.raises(ValueError, match=r"spare is an expert-parallel parameter.*expert_mp_group"):
        get_optimizer(model.config, [model], mp_group=SINGLE)


def broadcast_body():
    state = start(2)
    module = ToyMoE(state.ep)
    torch.manual_seed(state.rank)  # data-parallel random initialization: every rank differs
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    model = DistributedDataParallel(OptimizerConfig(lr=0.1), module, **groups(state))
    model.broadcast_params()
    values = {n: p.detach().clone() for n, p in module.named_parameters()}
    stop()
    return values


def test_broadcast_params_sends_experts_over_expert_dp():
    per_rank = run_on_ranks(broadcast_body, 4, timeout=60)  # ep groups {0, 1}, {2, 3}
    for name in per_rank[0]:
        if name in ("experts", "spare"):  # rank 0's experts on rank 2, rank 1's on rank 3
            torch.testing.assert_close(per_rank[2][name], per_rank[0][name], rtol=0, atol=0)
            torch.testing.assert_close(per_rank[3][name], per_rank[1][name], rtol=0, atol=0)
            assert not torch.equal(per_rank[0][name], per_rank[1][name])
        else:
            for values in per_rank[1:]:
                torch.testing.assert_close(values[name], per_rank[0][name], rtol=0, atol=0)


# --- training: norm, zeros, clipping, the distributed optimizer --------------------------------


def sgd_config(distributed: bool, overlap: bool) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="sgd", lr=0.5, sgd_momentum=0.9, clip_grad=0.05, log_num_zeros_in_grad=True,
        use_distributed_optimizer=distributed, overlap_grad_reduce=overlap,
        overlap_param_gather=distributed and overlap, bucket_size=8,
    )  # fmt: skip


def train(config, ep, dp, edp, mp, emp, steps=3):
    model = DistributedDataParallel(config, ToyMoE(ep), dp_group=dp, expert_dp_group=edp)
    optimizer = get_optimizer(config, [model], mp_group=mp, expert_mp_group=emp)
    reports = []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = my_part(global_batch(step), dp)
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        result = optimizer.step()
        reports.append((result.grad_norm, result.num_zeros_in_grad))
    model.finish_param_sync()  # overlap_param_gather leaves the last gathers running
    return model.module, reports


def train_body(ep: int):
    state = start(ep)
    want_model, want_reports = train(sgd_config(False, False), SINGLE, *[SINGLE] * 4)
    want = dict(want_model.named_parameters())
    results = {}
    for distributed, overlap in itertools.product((False, True), (False, True)):
        model, reports = train(
            sgd_config(distributed, overlap), state.ep, state.dp_cp, state.expert_dp, state.mp,
            state.tp_ep_pp,
        )  # fmt: skip
        error = max(
            float((p - want[name][rows]).abs().max()) for name, (p, rows) in model.logical().items()
        )
        results[(distributed, overlap)] = (reports, error)
    stop()
    return want_reports, results


@pytest.mark.parametrize("world,ep", LAYOUTS, ids=[f"w{w}-ep{e}" for w, e in LAYOUTS])
def test_training_equals_one_process(world, ep):
    for rank, (want, results) in enumerate(run_on_ranks(train_body, world, ep, timeout=120)):
        assert all(norm > 0.05 for norm, _ in want)  # clipping is active on every step
        assert all(zeros == 3 + E * R * 2 for _, zeros in want)  # `unused` and `spare`
        for (distributed, overlap), (reports, error) in results.items():
            where = f"rank {rank}, world {world}, ep {ep}, distributed={distributed}"
            for (norm, zeros), (want_norm, want_zeros) in zip(reports, want, strict=True):
                assert norm == pytest.approx(want_norm, rel=1e-6), where
                assert zeros == want_zeros, where
            assert error < 1e-6, f"{where}, overlap={overlap}: parameters off by {error:.2e}"


# --- optimizer state across expert-parallel sizes ----------------------------------------------


def adam_setup(state, distributed: bool):
    config = OptimizerConfig(
        lr=1e-2, weight_decay=0.1, use_distributed_optimizer=distributed, bucket_size=8
    )
    model = DistributedDataParallel(config, ToyMoE(state.ep), **groups(state))
    optimizer = get_optimizer(config, [model], mp_group=state.mp, expert_mp_group=state.tp_ep_pp)
    return model, optimizer


def adam_step(model, optimizer, step: int, dp: RankGroup):
    optimizer.zero_grad()
    x, y = my_part(global_batch(step), dp)
    torch.nn.functional.mse_loss(model(x), y).backward()
    model.finish_grad_sync()
    assert optimizer.step().update_successful


def detached(pieces) -> list[ShardedTensor]:
    return [
        ShardedTensor(p.key, p.data.detach().clone(), p.global_shape, p.global_offset,
                      p.replica_id, p.flattened_range, p.local_shape)
        for p in pieces
    ]  # fmt: skip


def logical_params(model) -> dict[str, tuple[torch.Tensor, slice]]:
    return {n: (p.detach().clone(), rows) for n, (p, rows) in model.module.logical().items()}


def save_body(ep: int, distributed: bool):
    state = start(ep)
    model, optimizer = adam_setup(state, distributed)
    for step in range(2):
        adam_step(model, optimizer, step, state.dp_cp)
    saved = optimizer.sharded_state_dict()
    result = {
        "model": detached(model.sharded_state_dict().values()),
        "optimizer": detached(saved["state"].values()),
        "common": saved["common"],
    }
    adam_step(model, optimizer, 2, state.dp_cp)
    result["after"] = logical_params(model)
    stop()
    return result


def load_body(ep: int, distributed: bool, model_tensors, optimizer_tensors, common):
    state = start(ep)
    model, optimizer = adam_setup(state, distributed)
    with torch.no_grad():
        for key, piece in model.sharded_state_dict().items():
            piece.data.copy_(piece.read_from(model_tensors[key]))
    template = optimizer.sharded_state_dict()["state"]
    filled = {
        key: ShardedTensor(key, piece.read_from(optimizer_tensors[key]), piece.global_shape,
                           piece.global_offset, piece.replica_id, piece.flattened_range,
                           piece.local_shape)
        for key, piece in template.items()
    }  # fmt: skip
    optimizer.load_sharded_state_dict({"state": filled, "common": common})
    adam_step(model, optimizer, 2, state.dp_cp)
    result = logical_params(model)
    stop()
    return result


def whole_model(per_rank) -> dict[str, torch.Tensor]:
    """The logical tensors: each distinct piece once (dense ones repeat on dp ranks)."""
    distinct = {(p.key, p.global_offset): p for r in per_rank for p in r["model"]}
    return assemble(distinct.values())


SAVES = [(2, 2, True), (4, 2, False), (2, 1, True)]  # (world, ep, distributed)
LOADS = [(1, 1, False), (2, 1, True), (2, 2, False), (2, 2, True), (4, 2, True), (4, 4, True)]


@pytest.mark.parametrize("saved_at", SAVES, ids=[f"w{w}-ep{e}-d{int(d)}" for w, e, d in SAVES])
def test_optimizer_state_loads_under_other_expert_parallel_sizes(saved_at):
    world, ep, distributed = saved_at
    saved = run_on_ranks(save_body, world, ep, distributed, timeout=60)
    pieces = [p for r in saved for p in r["optimizer"]]
    shapes = check_tiling(pieces)  # expert state too: every element saved exactly once
    assert shapes["optimizer.exp_avg.experts"] == (E * R, D)
    model_tensors, optimizer_tensors = whole_model(saved), assemble(pieces)
    want = {}
    for r in saved:
        for name, (value, rows) in r["after"].items():
            want.setdefault(name, torch.zeros(shapes[f"optimizer.exp_avg.{name}"]))[rows] = value
    for load_world, load_ep, load_distributed in LOADS:
        results = run_on_ranks(
            load_body, load_world, load_ep, load_distributed, model_tensors, optimizer_tensors,
            saved[0]["common"], timeout=60,
        )  # fmt: skip
        for rank, got in enumerate(results):
            for name, (value, rows) in got.items():
                error = float((value - want[name][rows]).abs().max())
                assert error < 1e-6, (
                    f"saved at {saved_at}, loaded at world {load_world} ep {load_ep} "
                    f"distributed={load_distributed}, rank {rank}: {name} off by {error:.2e}"
                )
