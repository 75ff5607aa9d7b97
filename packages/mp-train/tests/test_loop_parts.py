"""The micro-batch calculator (constant and ramp-up), the timers, which learning rate the
log shows, where the loop empties the CUDA caching allocator, and the bf16 matmul switch."""

import time
from types import SimpleNamespace

import pytest
import torch

from mp_train import MicroBatchCalculator, Timers
from mp_train.loop.forward_backward import empty_unused_memory
from mp_train.loop.setup import set_matmul_precision
from mp_train.observability.metrics import logged_lr


def test_constant_global_batch():
    calculator = MicroBatchCalculator(64, 2, 4)
    assert calculator.num_microbatches(0) == 8 and calculator.global_batch(10**6) == 64
    with pytest.raises(ValueError, match="global_batch_size=30 is not divisible"):
        MicroBatchCalculator(30, 2, 4)


def test_rampup_batch_size():
    # start 16, +16 every 1000 / ((64 - 16) / 16) = 333.3 samples, 64 after 1000 samples.
    calculator = MicroBatchCalculator(64, 2, 4, rampup_batch_size=[16, 16, 1000])
    sizes = [calculator.global_batch(n) for n in (0, 333, 334, 666, 667, 1000, 1001)]
    assert sizes == [16, 16, 32, 32, 48, 64, 64]
    assert calculator.num_microbatches(0) == 2 and calculator.num_microbatches(2000) == 8
    with pytest.raises(ValueError, match="not divisible by micro_batch_size x data_parallel"):
        MicroBatchCalculator(64, 2, 4, rampup_batch_size=[12, 4, 100])


def test_timers_levels_and_report():
    timers = Timers(log_level=1, log_option="minmax")
    timers("work", log_level=1).start()
    time.sleep(0.01)
    timers("work", log_level=1).stop()
    timers("detail", log_level=2).start()  # above the level: not timed
    timers("detail", log_level=2).stop()
    line = timers.report(["work", "detail"])
    assert line.startswith("time (ms) | work: (") and "detail" not in line
    low, high = (float(x) for x in line.split("(")[-1].rstrip(")").split(", "))
    assert 9 <= low == high < 200
    with pytest.raises(RuntimeError, match="not running"):
        timers("work", log_level=1).stop()


def test_the_log_shows_the_lr_of_the_groups_that_follow_lr():
    decoupled = {"lr": 5e-3, "decoupled_lr": True}
    assert logged_lr([decoupled, {"lr": 1e-3}, {"lr": 1e-3}]) == 1e-3
    assert logged_lr([decoupled]) == 5e-3  # a stage with nothing else
    assert logged_lr([]) == 0.0


@pytest.mark.parametrize("level,emptied", [(0, []), (1, [1]), (2, [1, 2])])
def test_empty_unused_memory_level_empties_at_megatrons_points(monkeypatch, level, emptied):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(point))
    config = SimpleNamespace(training=SimpleNamespace(empty_unused_memory_level=level))
    for device in ("cpu", "cuda"):  # a CPU has no caching allocator
        run = SimpleNamespace(config=config, device=torch.device(device))
        for point in (1, 2):  # 1: after forward-backward and evaluation steps; 2: optimizer
            empty_unused_memory(run, level=point)
    assert calls == emptied


def test_disable_bf16_reduced_precision_matmul_sets_torchs_switch_with_bf16_on_cuda():
    matmul = torch.backends.cuda.matmul  # a switch torch keeps even without CUDA
    before = matmul.allow_bf16_reduced_precision_reduction
    asked = SimpleNamespace(bf16=True, disable_bf16_reduced_precision_matmul=True)
    fp32 = SimpleNamespace(bf16=False, disable_bf16_reduced_precision_matmul=True)
    try:
        matmul.allow_bf16_reduced_precision_reduction = True
        for model, device in ((asked, "cpu"), (fp32, "cuda")):
            set_matmul_precision(model, torch.device(device))
            assert matmul.allow_bf16_reduced_precision_reduction
        set_matmul_precision(asked, torch.device("cuda"))
        assert not matmul.allow_bf16_reduced_precision_reduction
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def test_a_step_batch_size_schedule():
    from mp_train.loop.microbatches import parse_batch_schedule

    # Megatron-LM's release line at seq 4096: thresholds in tokens, samples rounded down
    entries = parse_batch_schedule("0:384 200B:768 400B:1152", 4096)
    assert entries == [(0, 384), (48828125, 768), (97656250, 1152)]
    assert parse_batch_schedule("10K:8, 0:4 1.5k:6", 100) == [(0, 4), (15, 6), (100, 8)]
    calculator = MicroBatchCalculator(2 * 4, 2, 4, schedule=[(0, 8), (20, 16), (40, 24)])
    assert calculator.global_batch_size == 24  # the largest, for the sample counts
    sizes = [calculator.global_batch(n) for n in (0, 19, 20, 39, 40, 10**9)]
    assert sizes == [8, 8, 16, 16, 24, 24]
    assert calculator.num_microbatches(25) == 2
    assert calculator.samples_for(5) == 8 + 8 + 8 + 16 + 24  # from 0, 8, 16, 24, 40 consumed
    late = MicroBatchCalculator(8, 2, 4, schedule=[(0, 8), (100, 12)])
    assert late.num_microbatches(99) == 1  # a size is checked when it is reached
    with pytest.raises(ValueError, match=r"global batch 12 from sample 100 on \(consumed: 100"):
        late.num_microbatches(100)
    for text, message in (("4:8", "the first threshold must be 0"),
                          ("0:8 5:16 5:24", "the thresholds must increase"),
                          ("0:8 1x:16", "'1X' is not a number"),
                          ("0:8 16", "'16' is not THRESHOLD:BATCH_SIZE"),
                          ("0:0", "batch sizes must be >= 1")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_batch_schedule(text, 1)


def test_a_decreased_batch_counts_the_rest_as_skipped():
    calculator = MicroBatchCalculator(4, 1, 4, requested_global_batch_size=6)
    assert (calculator.global_batch(100), calculator.num_microbatches(100)) == (4, 1)
    assert calculator.shortfall == 2
    assert MicroBatchCalculator(8, 2, 4).shortfall == 0
