"""The one line a failed rank reports (`error: rank R: ...` in apps/gpt's pretrain, a
failed save's message): a failed checkpoint save, which torch reports from every rank at
once (CheckpointException, a BaseException), names this rank's own failure, or the rank
it came from; a full disk is found deep in the chain of causes."""

import errno

from torch.distributed.checkpoint.api import CheckpointException

from mp_ckpt import failure_line
from mp_ckpt.core.failures import has_errno


def test_a_failed_save_names_the_cause_and_the_rank_it_came_from():
    died = RuntimeError("DataLoader worker (pid 5) is killed by signal: Killed.")
    error = CheckpointException("save failed", {1: (died, None)})
    assert failure_line(error, 1) == "DataLoader worker (pid 5) is killed by signal: Killed."
    assert failure_line(error, 0) == (
        "checkpoint failed on rank 1: DataLoader worker (pid 5) is killed by signal: Killed."
    )


def test_other_errors_give_their_first_line():
    assert failure_line(ValueError("bad\nmore"), 0) == "bad"
    assert failure_line(RuntimeError(), 3) == "RuntimeError"


def test_a_full_disk_is_found_in_causes_and_gathered_failures():
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as cause:
            raise RuntimeError("write failed") from cause
    except RuntimeError as wrapped:
        assert has_errno(wrapped, errno.ENOSPC)
        assert has_errno(CheckpointException("save failed", {0: (wrapped, None)}), errno.ENOSPC)
    assert not has_errno(OSError(errno.EIO, "I/O error"), errno.ENOSPC)
    assert not has_errno(RuntimeError("unexpected pos 704 vs 598"), errno.ENOSPC)
