"""Progress of long work (mp_ckpt.core.progress, mp_data.progress): a tqdm bar on a terminal,
plain periodic lines without carriage returns elsewhere; mp-ckpt's commands and
mp-data merge report through it."""

from __future__ import annotations

import fcntl
import inspect
import io
import os
import select
import struct
import termios

import numpy as np
import pytest
import torch

import mp_ckpt.core.progress
import mp_data.progress
from mp_ckpt import Checkpointer, ShardedTensor
from mp_ckpt.cli import main as ckpt_main
from mp_data import IndexedDatasetBuilder
from mp_data.cli import main as data_main

MODULES = [mp_ckpt.core.progress, mp_data.progress]


def test_the_two_copies_are_the_same_code():
    """Each package installs alone, so each has the helper: they must not drift apart."""
    ckpt, data = (inspect.getsource(m).split('"""', 2)[2] for m in MODULES)
    assert ckpt == data


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_off_a_terminal_a_line_each_tenth_and_at_the_end(module):
    stream = io.StringIO()
    with module.progress(40, "convert", unit="tensor", stream=stream) as bar:
        for _ in range(40):
            bar.update()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        *(f"convert: {4 * i}/40 tensors ({10 * i}%)" for i in range(1, 10)),
        "convert: 40/40 tensors (100%)",
    ]
    assert lines[-1].endswith(", done")


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_off_a_terminal_without_a_total_a_line_every_so_often(module, monkeypatch):
    monkeypatch.setattr(module, "LINE_SECONDS", 0.0)
    stream = io.StringIO()
    bar = module.progress(None, "export-hf", unit="tensor", stream=stream)
    bar.update(3)
    bar.set_postfix_str("shard 1")
    bar.update(2)
    bar.close()
    assert stream.getvalue().splitlines() == [
        "export-hf: 3 tensors, 0 s",
        "export-hf: 5 tensors, 0 s, shard 1",
        "export-hf: 5 tensors, 0 s, shard 1, done",
    ]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_on_a_terminal_a_bar_and_disabled_nothing(module):
    leader, follower = os.openpty()
    # A new pseudo-terminal is 0 x 0: give it a terminal's 24 rows of 80 columns.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    with (
        os.fdopen(follower, "w") as terminal,
        module.progress(4, "merge", unit="dataset", stream=terminal) as bar,
    ):
        for _ in range(4):
            bar.update()
    drawn = b""
    while select.select([leader], [], [], 0.5)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower closed
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    drawn = drawn.decode()
    assert "\r" in drawn and "merge: 100%" in drawn and "4/4" in drawn
    quiet = io.StringIO()
    with module.progress(4, "merge", stream=quiet, enabled=False) as bar:
        bar.update(4)
    assert quiet.getvalue() == ""


def test_mp_ckpt_convert_reports_each_tensor_in_lines(tmp_path, capsys):
    pieces = {f"w{i}": ShardedTensor(f"w{i}", torch.ones(2, 2), (2, 2), (0, 0))
              for i in range(10)}  # fmt: skip
    Checkpointer(tmp_path / "ckpt").save(3, pieces, common={"iteration": 3})
    assert ckpt_main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines()[0].startswith("convert: 1/10 tensors (10%), ")
    assert err.splitlines()[-1].endswith("done") and "10/10 tensors (100%)" in err
    assert ckpt_main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "o2"),
                      "--no-progress"]) == 0  # fmt: skip
    assert capsys.readouterr().err == ""


def test_mp_data_merge_reports_each_dataset_in_lines(tmp_path, capsys):
    prefixes = []
    for i in range(2):
        prefixes.append(str(tmp_path / f"part{i}"))
        with IndexedDatasetBuilder(prefixes[-1] + ".bin", np.int32) as builder:
            builder.add_document(np.arange(5), [5])
            builder.finalize(prefixes[-1] + ".idx")
    assert data_main(["merge", "--input", *prefixes, "--output-prefix",
                      str(tmp_path / "all")]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [line.split(",")[0] for line in err.splitlines()] == [
        "merge: 1/2 datasets (50%)",
        "merge: 2/2 datasets (100%)",
    ]
