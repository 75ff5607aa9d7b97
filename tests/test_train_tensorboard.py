"""TensorBoard under Megatron-LM's tags and cadence, and --profile's traces, end to end.

A tiny PP2 run on two gloo ranks (the last rank writes) with every TensorBoard
switch on, read back with TensorBoard's EventAccumulator: the exact tag set,
each tag's steps (per-iteration tags at 1..N, their `vs samples` series at the
consumed samples, timing tags every log_interval, validation at each
evaluation, the test split's at the end, under its own tags) and the values the
run logged (the metrics file, exact in float32; the printed evaluation lines). The
same run profiles iteration 2 on rank 0 only. A one-rank MoE run checks
tensorboard_log_interval and the MoE auxiliary-loss tags.
"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mp_gpt.testing import (
    GIVEN_PEAK,
    TINY_CONFIG,
    metrics_records,
    tiny_moe_options,
    train_printed_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS, GLOBAL_BATCH = 6, 4

PER_ITERATION = ["learning-rate", "lm loss", "batch-size", "loss-scale", "world-size",
                 "grad-norm", "num-zeros", "params-norm"]  # fmt: skip
TIMING = ["iteration-time", "throughput", "forward-backward-time", "optimizer-time"]
MEMORY = ["mem-allocated-bytes", "mem-max-allocated-bytes"]  # on CPUs
VALIDATION = ["lm loss validation", "lm loss validation ppl"]
TEST = ["lm loss test", "lm loss test ppl"]  # Megatron-LM writes it under VALIDATION


def options(run_dir: Path) -> list[str]:
    return [
        "--config", str(TINY_CONFIG), "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--make-vocab-size-divisible-by", "512",
        "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(ITERATIONS),
        "--pipeline-model-parallel-size", "2", "--eval-interval", "3", "--eval-iters", "1",
        "--log-interval", "2", "--timing-log-level", "1", "--lr-warmup-iters", "2",
        "--save", "none", "--load", "none", "--num-workers", "0",
        "--metrics-file", str(run_dir / "metrics.jsonl"),
        "--tensorboard-dir", str(run_dir / "tb"), "--tensorboard-log-interval", "1",
        "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--log-world-size-to-tensorboard", "--log-memory-to-tensorboard",
        "--log-num-zeros-in-grad", "--log-params-norm",
        "--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
        "--profile-step-end", "3", "--profile-ranks", "0",
    ]  # fmt: skip


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tensorboard")
    printed = run_on_ranks(train_printed_on_rank, 2, options(run_dir), timeout=300)
    return run_dir, printed


def test_tags_steps_and_values(pp2_run):
    run_dir, printed = pp2_run
    got = scalars(run_dir / "tb")
    validation = [*VALIDATION, *TEST, *(f"{t} vs samples" for t in [*VALIDATION, *TEST])]
    per_iteration = [*PER_ITERATION, *(f"{t} vs samples" for t in PER_ITERATION)]
    assert sorted(got) == sorted([*per_iteration, *MEMORY, *TIMING, *validation])

    records = metrics_records(run_dir)
    iterations = list(range(1, ITERATIONS + 1))
    samples = [GLOBAL_BATCH * i for i in iterations]
    assert [r["iteration"] for r in records] == iterations
    for tag in [*PER_ITERATION, *MEMORY]:
        assert [step for step, _ in got[tag]] == iterations, tag
    for tag in PER_ITERATION:
        assert [step for step, _ in got[f"{tag} vs samples"]] == samples, tag
        assert [v for _, v in got[f"{tag} vs samples"]] == [v for _, v in got[tag]], tag
    for tag in TIMING:  # every log_interval, not every tensorboard_log_interval
        assert [step for step, _ in got[tag]] == [2, 4, 6], tag
        assert all(v > 0 for _, v in got[tag]), tag

    logged = {"learning-rate": "lr", "lm loss": "lm loss", "batch-size": "global_batch_size",
              "loss-scale": "loss_scale", "grad-norm": "grad_norm"}  # fmt: skip
    for tag, key in logged.items():  # each iteration's own value, as float32 in the event
        assert [v for _, v in got[tag]] == [np.float32(r[key]) for r in records], tag
    assert [v for _, v in got["world-size"]] == [2.0] * ITERATIONS
    assert all(v > 0 for _, v in got["params-norm"])

    # Evaluations at iterations 3 and 6 (the final one), against the printed values.
    lines = [line for line in printed[1].splitlines() if "validation" in line]
    shown = [float(re.search(r"\| lm loss (\S+)", line).group(1)) for line in lines]
    assert [step for step, _ in got["lm loss validation"]] == [3, 6]
    assert [step for step, _ in got["lm loss validation vs samples"]] == [12, 24]
    for (_, loss), want in zip(got["lm loss validation"], shown, strict=True):
        assert loss == pytest.approx(want, rel=1e-5)
    for (_, loss), (_, ppl) in zip(got["lm loss validation"], got["lm loss validation ppl"],
                                   strict=True):  # fmt: skip
        assert ppl == pytest.approx(math.exp(loss), rel=1e-6)
    # The test split's, once, at the end.
    line = next(line for line in printed[1].splitlines() if line.startswith("test at "))
    assert line.startswith(f"test at iteration {ITERATIONS} | ")
    assert got["lm loss test vs samples"] == [
        (ITERATIONS * GLOBAL_BATCH, got["lm loss test"][0][1])
    ]
    [(step, loss)], [(_, ppl)] = got["lm loss test"], got["lm loss test ppl"]  # one each
    assert step == ITERATIONS
    assert loss == pytest.approx(float(re.search(r"\| lm loss (\S+)", line).group(1)), rel=1e-5)
    assert ppl == pytest.approx(math.exp(loss), rel=1e-6)


def test_profile_traces_the_given_iterations_on_the_given_ranks(pp2_run):
    run_dir, _ = pp2_run
    traces = sorted(p.name for p in (run_dir / "tb").glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].startswith("rank0."), traces
    events = json.loads((run_dir / "tb" / traces[0]).read_text())["traceEvents"]
    ranges = {e["name"] for e in events if str(e.get("name", "")).startswith("iteration ")}
    assert ranges == {"iteration 2"}


def test_interval_and_moe_tags(tmp_path):
    argv = tiny_moe_options(tmp_path, "--tensorboard-dir", str(tmp_path / "tb"),
                            "--tensorboard-log-interval", "2")  # fmt: skip
    run_on_ranks(train_printed_on_rank, 1, argv, timeout=300)
    got = scalars(tmp_path / "tb")
    records = metrics_records(tmp_path)
    every = ["learning-rate", "lm loss", "batch-size", "loss-scale", "grad-norm"]
    moe = ["load_balancing_loss", "z_loss"]  # Megatron's MoE tags: every iteration, no vs samples
    assert sorted(got) == sorted([*every, *(f"{t} vs samples" for t in every), *moe])
    for tag in every:
        assert [step for step, _ in got[tag]] == [2, 4], tag
    for tag in moe:
        assert [step for step, _ in got[tag]] == [1, 2, 3, 4], tag
        assert [v for _, v in got[tag]] == [np.float32(r[tag]) for r in records], tag
    assert [v for _, v in got["lm loss"]] == [np.float32(r["lm loss"]) for r in records[1::2]]


def test_moe_per_layer_tags(tmp_path):
    """--moe-per-layer-logging: each layer's auxiliary losses every iteration, under
    Megatron's tags (`moe/<name>_layer_<i>`, 0 for the dense first layer, the MTP module's
    layer numbered 4), summing to the averages times the MoE layers; at PP2 (the layers
    on two stages) the same values; the printed line keeps the averages."""
    flags = ["--moe-per-layer-logging", "--moe-layer-freq", "[0,1,1,1]", "--mtp-num-layers",
             "1", "--log-interval", "1"]  # fmt: skip
    runs = {}
    for name, ranks, layout in (
        ("one", 1, []),
        ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
    ):
        run_dir = tmp_path / name
        argv = tiny_moe_options(run_dir, "--tensorboard-dir", str(run_dir / "tb"), *flags,
                                *layout)  # fmt: skip
        printed = run_on_ranks(train_printed_on_rank, ranks, argv, timeout=300)[-1]
        assert "load_balancing_loss" in printed and "_layer_" not in printed
        runs[name] = scalars(run_dir / "tb"), metrics_records(run_dir)
    got, records = runs["one"]
    for loss in ("load_balancing_loss", "z_loss"):
        tags = [f"moe/{loss}_layer_{i}" for i in range(5)]
        assert set(tags) <= got.keys()
        for tag in tags:
            assert [step for step, _ in got[tag]] == [1, 2, 3, 4], tag
            assert [v for _, v in got[tag]] == [np.float32(r[tag]) for r in records], tag
        for record in records:
            layers = [record[tag] for tag in tags]
            assert layers[0] == 0 and all(v > 0 for v in layers[1:]), (loss, layers)
            assert sum(layers) / 4 == pytest.approx(record[loss], rel=1e-6)
        for tag in tags:
            pp2 = [v for _, v in runs["pp2"][0][tag]]
            assert pp2 == pytest.approx([v for _, v in got[tag]], rel=1e-5), tag
