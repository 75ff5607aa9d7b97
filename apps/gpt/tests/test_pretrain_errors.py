"""The one line a rank prints when it fails alone (`error: rank R: ...`): a failed
checkpoint save, which torch reports from every rank at once (CheckpointException, a
BaseException), names this rank's own failure, or the rank it came from."""

from torch.distributed.checkpoint.api import CheckpointException

from mp_gpt.pretrain import _cause


def test_a_failed_save_names_the_cause_and_the_rank_it_came_from():
    died = RuntimeError("DataLoader worker (pid 5) is killed by signal: Killed.")
    error = CheckpointException("save failed", {1: (died, None)})
    assert _cause(error, 1) == "DataLoader worker (pid 5) is killed by signal: Killed."
    assert _cause(error, 0) == (
        "checkpoint failed on rank 1: DataLoader worker (pid 5) is killed by signal: Killed."
    )


def test_other_errors_give_their_first_line():
    assert _cause(ValueError("bad\nmore"), 0) == "bad"
    assert _cause(RuntimeError(), 3) == "RuntimeError"
