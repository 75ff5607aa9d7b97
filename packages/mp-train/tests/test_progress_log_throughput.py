"""The progress log's job throughput counts from when the job's processes started, as
Megatron's (its _TRAIN_START_TIME): a job that started 100 s ago, having done 3.5e14
operations on 2 ranks since its checkpoint's 5e13, shows (3.5e14 - 5e13) /
(100 s x 2 x 1e12) = 1.5 TFLOP/s/GPU, not what the moments since its checkpoint was
loaded would give."""

import time

import pytest

from mp_train.observability.progress_log import ProgressLog


def test_job_throughput_counts_from_the_job_start(tmp_path):
    log = ProgressLog(tmp_path, world_size=2, writes=True)
    log.job_started(5e13, time.time() - 100)
    log.saved(10, 3.5e14, tokens=4096, async_save=False)
    line = (tmp_path / "progress.txt").read_text().splitlines()[-1]
    fields = dict(f.split(": ", 1) for f in line.split("\t")[1:] if ": " in f)
    assert "\tSaved checkpoint\t" in line
    assert float(fields["Job throughput"].split()[0]) == pytest.approx(1.5, abs=0.05)
    assert fields["Floating-point operations"] == "3.50e+14"
