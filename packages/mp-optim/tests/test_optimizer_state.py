"""Optimizer state saved under one data-parallel layout loads under another.

A model with a fused parameter described as strided logical parts (as the QKV
projection is) trains 2 steps at DP 2 with the distributed optimizer; its
model and optimizer pieces are assembled into whole logical tensors (what a
checkpoint holds), loaded at DP 1, 3 and 4 (distributed and plain) and at
DP 2 plain, and the third step must equal the third step of the original run
(bf16: at DP 2 plain and distributed, where the bf16 arithmetic is the same).
"""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import ShardedTensor, assemble, check_tiling
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

GROUPS, PER_GROUP, D, H, BATCH = 2, 2, 3, 5, 12


class FusedToy(torch.nn.Module):
    """y = tanh(x W_fused^T + b) V^T with W_fused laid out group by group: [q q k v] x 2."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        rows = GROUPS * (PER_GROUP + 2) * D
        self.fused = torch.nn.Parameter(torch.randn(rows, H, dtype=dtype) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(rows, dtype=dtype) * 0.1)
        self.out = torch.nn.Parameter(torch.randn(4, rows, dtype=dtype) * 0.3)

    def forward(self, x):
        return torch.tanh(x @ self.fused.t() + self.bias) @ self.out.t()

    def sharded_state_dict(self, prefix=""):
        fused = self.fused.view(GROUPS, PER_GROUP + 2, D, H)
        parts = {
            "q": fused[:, :PER_GROUP],
            "k": fused[:, PER_GROUP],
            "v": fused[:, PER_GROUP + 1],
        }
        pieces = {
            f"{prefix}{name}": ShardedTensor(
                f"{prefix}{name}", data, tuple(data.shape), (0,) * data.dim()
            )
            for name, data in parts.items()
        }
        for name in ("bias", "out"):
            p = getattr(self, name)
            pieces[f"{prefix}{name}"] = ShardedTensor(
                f"{prefix}{name}", p.data, tuple(p.shape), (0,) * p.dim()
            )
        return pieces


def global_batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, H, generator=generator), torch.randn(BATCH, 4, generator=generator)


def setup(distributed: bool, dtype, state):
    config = OptimizerConfig(
        lr=1e-2, weight_decay=0.1, bf16=dtype == torch.bfloat16,
        use_distributed_optimizer=distributed, bucket_size=40,
    )  # fmt: skip
    model = DistributedDataParallel(config, FusedToy(dtype), dp_group=state.dp)
    return model, get_optimizer(config, [model], mp_group=state.mp)


def train_step(model, optimizer, step: int, dp):
    x, y = global_batch(step)
    x, y = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
    optimizer.zero_grad()
    out = model(x.to(model.module.fused.dtype)).float()
    torch.nn.functional.mse_loss(out, y).backward()
    model.finish_grad_sync()
    assert optimizer.step().update_successful


def detached(pieces: dict) -> list[ShardedTensor]:
    return [
        ShardedTensor(
            p.key,
            p.data.detach().clone(),
            p.global_shape,
            p.global_offset,
            p.replica_id,
            p.flattened_range,
            p.local_shape,
        )
        for p in pieces.values()
    ]


def save_body(dtype):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    model, optimizer = setup(True, dtype, state)
    for step in range(2):
        train_step(model, optimizer, step, state.dp)
    saved = optimizer.sharded_state_dict()
    result = {
        "model": detached(model.sharded_state_dict()),
        "optimizer": detached(saved["state"]),
        "common": saved["common"],
    }
    train_step(model, optimizer, 2, state.dp)
    result["after"] = [p.detach().float().clone() for p in model.module.parameters()]
    mp_state.destroy()
    dist.barrier()
    return result


def load_body(distributed: bool, dtype, model_tensors, optimizer_tensors, common):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    model, optimizer = setup(distributed, dtype, state)
    with torch.no_grad():
        for key, piece in model.sharded_state_dict().items():
            piece.data.copy_(piece.read_from(model_tensors[key]))
    template = optimizer.sharded_state_dict()
    filled = {
        key: ShardedTensor(
            key,
            piece.read_from(optimizer_tensors[key]),
            piece.global_shape,
            piece.global_offset,
            piece.replica_id,
            piece.flattened_range,
            piece.local_shape,
        )
        for key, piece in template["state"].items()
    }
    optimizer.load_sharded_state_dict({"state": filled, "common": common})
    train_step(model, optimizer, 2, state.dp)
    after = [p.detach().float().clone() for p in model.module.parameters()]
    mp_state.destroy()
    dist.barrier()
    return after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_distributed_optimizer_state_loads_under_other_dp_sizes(dtype):
    saved = run_on_ranks(save_body, 2, dtype, timeout=60)
    optimizer_pieces = [p for r in saved for p in r["optimizer"]]
    assert any(p.flattened_range is not None for p in optimizer_pieces)
    shapes = check_tiling(optimizer_pieces)
    expected = {"exp_avg", "exp_avg_sq"} | ({"fp32_param"} if dtype == torch.bfloat16 else set())
    assert {key.split(".")[1] for key in shapes} == expected
    model_tensors = assemble(saved[0]["model"])  # dp replicas: one rank's pieces
    optimizer_tensors = assemble(optimizer_pieces)
    want = saved[0]["after"]
    layouts = [(1, False), (2, False), (3, True), (4, True), (1, True), (2, True)]
    if dtype == torch.bfloat16:  # other dp sizes change the bf16 forward's rounding
        layouts = [(2, False), (2, True)]
    for dp, distributed in layouts:
        results = run_on_ranks(
            load_body, dp, distributed, dtype, model_tensors, optimizer_tensors,
            saved[0]["common"], timeout=60,
        )  # fmt: skip
        for rank, got in enumerate(results):
            for g, w in zip(got, want, strict=True):
                error = float((g - w).norm() / w.norm())
                assert error < 1e-6, f"dp={dp} distributed={distributed} rank {rank}: {error:.2e}"


def test_a_wrong_state_would_show():
    """Loading zeros instead of the saved moments changes the third step."""
    saved = run_on_ranks(save_body, 2, torch.float32, timeout=60)
    model_tensors = assemble(saved[0]["model"])  # dp replicas: one rank's pieces
    zeros = {k: torch.zeros_like(v) for k, v in assemble(
        p for r in saved for p in r["optimizer"]).items()}  # fmt: skip
    got = run_on_ranks(load_body, 1, False, torch.float32, model_tensors, zeros,
                       saved[0]["common"], timeout=60)[0]  # fmt: skip
    assert (
        max(float((g - w).norm() / w.norm()) for g, w in zip(got, saved[0]["after"], strict=True))
        > 1e-4
    )


def groups_body(saved_edit, **loading):
    """Saves a one-rank optimizer's state (decoupled lr 1e-2 on `out`), edits its groups
    with saved_edit and loads it into an optimizer built with `loading`'s config changes:
    the loaded groups, or the refusal's message."""
    from mp_optim.optimizer_state import load_optimizer_state, optimizer_sharded_state_dict

    state = mp_state.initialize(ParallelConfig())

    def build(**changes):
        toy = FusedToy(torch.float32)
        toy.out.is_embedding_or_output_parameter = True
        config = OptimizerConfig(**{"lr": 1e-3, "decoupled_lr": 1e-2, **changes})
        model = DistributedDataParallel(config, toy, dp_group=state.dp)
        return get_optimizer(config, [model], mp_group=state.mp)

    saved = optimizer_sharded_state_dict(build())
    saved_edit(saved["common"]["param_groups"])
    optimizer = build(**loading)
    try:
        load_optimizer_state(optimizer, saved)
        got = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    except ValueError as error:
        got = str(error)
    mp_state.destroy()
    return got


def _imported(groups):  # a Megatron-LM import carries the ends in every group
    for group in groups:
        group.setdefault("max_lr", 5e-4)
        group.setdefault("min_lr", 0.0)


def test_saved_groups_are_checked_and_the_decoupled_ends_settled():
    def same(groups):
        pass

    def undecoupled(groups):  # as if saved without --decoupled-lr
        del groups[-1]["decoupled_lr"]

    def changed_peak(groups):
        groups[-1]["max_lr"] = 2e-2

    def run(edit, **loading):
        return run_on_ranks(groups_body, 1, edit, timeout=60, **loading)[0]

    kinds = [(g["wd_mult"], g.get("decoupled_lr", False)) for g in run(same)]
    assert kinds == [(0.0, False), (1.0, False), (1.0, True)]
    # Groups without ends of their own follow the scheduler, whatever the checkpoint says.
    loaded = run(_imported)
    assert [("max_lr" in g, g.get("max_lr")) for g in loaded] == [
        (False, None), (False, None), (True, 1e-2)]  # fmt: skip
    assert (
        "(wd_mult 1 lr_mult 1) stands where this optimizer has (wd_mult 1 lr_mult 1 "
        "decoupled lr)" in run(undecoupled)
    )
    assert "has max_lr=0.02, this run 0.01 (decoupled_lr)" in run(changed_peak)
    assert run(changed_peak, override_opt_param_scheduler=True)[-1]["max_lr"] == 1e-2
    assert run(changed_peak, use_checkpoint_opt_param_scheduler=True)[-1]["max_lr"] == 2e-2
