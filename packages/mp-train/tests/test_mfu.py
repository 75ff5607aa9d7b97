"""MFU against its reference: a measured reference taken while the machine was busy is
measured again, and an MFU above 1 is never shown; the CPU measure keeps its best round."""

import pytest

from mp_train.observability import metrics
from mp_train.observability.metrics import measure_peak_tflops, model_flops_utilization


def test_an_mfu_below_one_is_against_the_reference_as_it_is():
    calls = []
    assert model_flops_utilization(0.3, 0.6, lambda: calls.append(1) or 9.0) == (0.5, 0.6)
    assert not calls  # nothing measured again


def test_a_busy_measure_is_measured_again_and_raised():
    """Started under load, the reference was 0.004 TFLOP/s; the run does 0.3."""
    mfu, reference = model_flops_utilization(0.3, 0.004, lambda: 0.6)
    assert (mfu, reference) == (0.5, 0.6)


def test_an_mfu_still_above_one_is_not_shown():
    assert model_flops_utilization(0.3, 0.004, lambda: 0.1) == (None, 0.1)
    # a given peak (--peak-tflops) is not measured again, and is kept
    assert model_flops_utilization(0.3, 0.2, None) == (None, 0.2)


def test_the_cpu_measure_keeps_the_fastest_round(monkeypatch):
    """Clock readings of a busy first round (1 s a matmul), then quiet ones (1 ms)."""
    readings = iter([0.0, 1.0] * 2 + [10.0, 10.001] * 4)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(readings))
    monkeypatch.setattr(metrics.time, "sleep", lambda seconds: None)
    tflops = measure_peak_tflops(n=64, repeats=2, rounds=3)
    # the fastest, 1 ms: 2 x 64^3 FLOP, floating-point readings give 0.99999... ms
    assert tflops == pytest.approx(2 * 64**3 / 1e-3 / 1e12, rel=1e-6)


def _measures(monkeypatch, fp32: float, bf16: float) -> list:
    """measure_peak_tflops made to answer `fp32` or `bf16` by dtype; the calls kept."""
    calls = []

    def measure(n=1024, repeats=5, dtype=metrics.torch.bfloat16, rounds=3, device="cpu"):
        calls.append((n, dtype))
        return fp32 if dtype == metrics.torch.float32 else bf16

    monkeypatch.setattr(metrics, "measure_peak_tflops", measure)
    return calls


def test_a_cpu_without_native_bf16_is_measured_in_fp32_only(monkeypatch):
    """An AVX2 CPU: 0.12 TFLOP/s in fp32, 0.0007 in bf16 (seconds for one 1024 matmul)."""
    calls = _measures(monkeypatch, fp32=0.12, bf16=0.0007)
    assert metrics.cpu_peak_tflops() == 0.12
    assert calls == [(1024, metrics.torch.float32), (256, metrics.torch.bfloat16)]


def test_a_cpu_with_fast_bf16_takes_the_faster_measure(monkeypatch):
    calls = _measures(monkeypatch, fp32=0.3, bf16=1.1)
    assert metrics.cpu_peak_tflops() == 1.1
    assert calls[-1] == (1024, metrics.torch.bfloat16)
