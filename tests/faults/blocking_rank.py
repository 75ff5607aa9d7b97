"""apps/gpt's pretrain with one rank stuck in I/O: once rank BLOCK_RANK has run
BLOCK_AFTER forward steps, its main thread blocks reading a pipe nobody writes to (its
other threads run on). For tests/faults/test_hung_rank.py, under torchrun."""

import os
import sys

import torch.distributed as dist

import mp_gpt.pretrain as entry

original = entry.forward_step
calls = 0


def forward_step(data_iterator, model, **kwargs):
    global calls
    calls += 1
    if dist.get_rank() == int(os.environ["BLOCK_RANK"]) and calls > int(os.environ["BLOCK_AFTER"]):
        read_end, _write_end = os.pipe()
        os.read(read_end, 1)  # never returns: _write_end stays open and unwritten
    return original(data_iterator, model, **kwargs)


entry.forward_step = forward_step
sys.exit(entry.main())
