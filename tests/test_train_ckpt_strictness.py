"""Megatron's --dist-ckpt-strictness through the real loop: a run that asks for tensors
its checkpoint lacks (a multi-token prediction module added on resume) stops by default
(strict_load) and under raise_all, naming the missing keys; under log_all it warns naming
them and goes on from the checkpoint's iteration."""

import pytest

from mp_gpt.testing import metrics_records, tiny_options, train_output_on_rank
from mp_state.testing import RankFailure, run_on_ranks

pytestmark = pytest.mark.multirank


def test_a_missing_module_stops_or_is_logged(tmp_path):
    ckpt = ("--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"))
    first = tiny_options(tmp_path / "a", *ckpt, "--train-iters", "3", "--exit-interval", "2")
    assert run_on_ranks(train_output_on_rank, 1, first)[0][0] == 0
    grown = [*ckpt, "--train-iters", "3", "--mtp-num-layers", "1"]
    for strictness in ([], ["--dist-ckpt-strictness", "raise_all"]):
        with pytest.raises(RankFailure, match=r"missing keys \['mtp\."):
            run_on_ranks(train_output_on_rank, 1, tiny_options(tmp_path / "b", *grown,
                                                               *strictness))  # fmt: skip
    logged = tiny_options(tmp_path / "c", *grown, "--dist-ckpt-strictness", "log_all")
    status, printed = run_on_ranks(train_output_on_rank, 1, logged)[0]
    assert status == 0 and "missing keys (loaded without them): ['mtp." in printed, printed
    assert [r["iteration"] for r in metrics_records(tmp_path / "c")] == [3]
