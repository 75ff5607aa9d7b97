"""--torch-compile end to end: apps/gpt's tiny config (2 layers, bf16, SDPA attention)
trains 3 iterations with the losses of the eager run at TP2 with sequence parallelism
x PP2 (4 ranks: one launch covers the traced tensor-parallel collectives and the
pipeline stages, each compiling its own layer), and at DP2 under ZeRO-3 and ZeRO-2 with
full recompute (FSDP2's gathers and reductions run eagerly around each compiled layer:
its hooks are never traced).

Each rank trains eagerly, then compiled, in one process. The compiled run must compile
the layers into one graph (no graph break), never recompile (Dynamo's
error_on_recompile), log its first iteration's time, and keep the model's state_dict
and sharding keys. Losses agree within 2e-4 relative and gradient norms within 1e-3:
bf16 rounds each element to 2^-8 relative, and the compiled kernels round and fuse
differently; measured here, the losses differed by at most 2.5e-5 relative and the
gradient norms by 1.5e-4 (the gradients are bf16). Inductor compiles into the run's cache folder
(conftest.py: cold at the start of every run, as on a fresh machine), shared by the ranks.
"""

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch.distributed.tensor import DTensor

import mp_state
from mp_gpt.testing import metrics_records, tiny_options
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS = 3
LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--pipeline-model-parallel-size", "2"]  # fmt: skip


def eager_then_compiled(run_dir: str, layout: list[str], *more: list[str]) -> dict:
    """One rank: the eager run, then the compiled one (then a compiled run of each of
    `more` layouts); what the test checks of them."""
    torch.set_num_threads(1)
    # A test run earlier in the forking pytest worker may have compiled the same layer
    # code (its cache entries guard on that process's thread count): start clean.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")  # tiny.yaml's data paths, unused
    from mp_gpt.pretrain import train
    from mp_train import parse_config

    torch._inductor.config.compile_threads = 1  # the ranks share two cores already
    runs, keys, printed = {}, {}, io.StringIO()
    plan = [("eager", layout), ("compiled", [*layout, "--torch-compile"])]
    plan += [(f"compiled-{i}", [*extra, "--torch-compile"]) for i, extra in enumerate(more, 1)]
    for name, options in plan:
        argv = tiny_options(Path(run_dir, name), "--bf16", "--num-layers", "2",
                            "--attention-backend", "flash", "--train-iters", str(ITERATIONS),
                            *options)  # fmt: skip
        with (
            torch._dynamo.config.patch(error_on_recompile=True),
            contextlib.redirect_stdout(printed),
        ):
            runs[name] = train(parse_config(argv))
        wrapped = runs[name].model[0]  # DDP's or FSDP's wrapper, as a checkpoint reads it
        keys[name] = (list(wrapped.module.state_dict()), list(wrapped.sharded_state_dict()))
        mp_state.destroy()
    counters = torch._dynamo.utils.counters
    return {
        "compiled_layers": [runs[name].compiled_layers for name, _ in plan[1:]],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": dict(counters["graph_break"]),
        "same_keys": all(keys[name] == keys["eager"] for name, _ in plan),
        "sharded": [
            all(isinstance(p, DTensor) for p in runs[name].model[0].parameters())
            for name, _ in plan
        ],
        "printed": printed.getvalue(),
    }


def test_compiled_layers_train_as_eager(tmp_path):
    ranks = run_on_ranks(eager_then_compiled, 4, str(tmp_path), LAYOUT, timeout=600)
    for rank, seen in enumerate(ranks):
        assert seen["compiled_layers"] == [1], rank  # a stage's layer
        assert seen["graphs"] == 1 and not seen["graph_breaks"], (rank, seen)
        assert seen["same_keys"], rank
    assert "compiled 1 transformer layer of the last pipeline stage" in ranks[-1]["printed"]
    assert_trains_as_eager(tmp_path, "compiled")


ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
ZERO2_RECOMPUTE = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads",
                   "--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--recompute-num-layers", "1"]  # fmt: skip


def test_compiled_layers_under_fsdp_train_as_eager(tmp_path):
    """DP2: eager ZeRO-3, compiled ZeRO-3, then compiled ZeRO-2 with every layer
    recomputed (the same graph serves: no recompile), all on eager ZeRO-3's curve (ZeRO-2
    and ZeRO-3 train alike exactly: test_train_fsdp.py)."""
    ranks = run_on_ranks(eager_then_compiled, 2, str(tmp_path), ZERO3, ZERO2_RECOMPUTE,
                         timeout=600)  # fmt: skip
    for rank, seen in enumerate(ranks):
        assert seen["compiled_layers"] == [2, 2], rank
        assert seen["graphs"] == 1 and not seen["graph_breaks"], (rank, seen)
        assert seen["same_keys"] and seen["sharded"] == [True] * 3, (rank, seen["sharded"])
    for name in ("compiled", "compiled-1"):
        assert_trains_as_eager(tmp_path, name)


def assert_trains_as_eager(run_dir: Path, name: str) -> None:
    eager = metrics_records(run_dir / "eager")
    compiled = metrics_records(run_dir / name)
    assert len(eager) == len(compiled) == ITERATIONS
    for got, want in zip(compiled, eager, strict=True):
        for key, tolerance in (("lm loss", 2e-4), ("grad_norm", 1e-3)):
            assert abs(got[key] - want[key]) <= tolerance * abs(want[key]), (name, key, got, want)
