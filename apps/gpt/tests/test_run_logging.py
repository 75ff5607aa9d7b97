"""pretrain_gpt shows mp's Python log records (rank 0's info lines by default) and
--logging-level hides them."""

from __future__ import annotations

import os
import subprocess
import sys

from mp_gpt.config_files import config_path

OPTIONS = [
    "--config", str(config_path("tiny.yaml")), "--mock-data", "--skip-train",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seq-length", "64",
    "--train-iters", "100", "--eval-interval", "none", "--save", "none", "--load", "none",
    "--tensorboard-dir", "none", "--num-workers", "0",
]  # fmt: skip
INFO = "[rank 0] INFO mp_train: torch.distributed initialized: world size 1, backend gloo"


def _run(*extra: str) -> str:
    env = {**os.environ, "MP_RUN_DIR": "/nonexistent", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "mp_gpt.pretrain", *OPTIONS, *extra],
                          env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_info_lines_show_and_the_level_hides_them():
    assert INFO in _run()
    assert INFO not in _run("--logging-level", "WARNING")
