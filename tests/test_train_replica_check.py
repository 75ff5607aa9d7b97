"""--check-weight-hash-across-dp-replicas-interval (loop/replica_check.py): replicas that
agree pass, and the loop says so at the interval; a parameter changed on one
data-parallel rank stops the check naming it and the rank; FSDP refuses the flag."""

import pytest
import torch

import mp_state
from mp_gpt.testing import tiny_options, train_printed_on_rank
from mp_optim import DistributedDataParallel, OptimizerConfig
from mp_state import ParallelConfig
from mp_state.testing import RankFailure, run_on_ranks
from mp_train.loop.replica_check import check_weight_replicas

pytestmark = pytest.mark.multirank


def drifted_on_rank(drift: bool) -> None:
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model = DistributedDataParallel(OptimizerConfig(lr=1e-3), module, dp_group=state.dp)
    check_weight_replicas([model])  # the same draw everywhere: passes
    if drift and state.dp.rank == 1:
        with torch.no_grad():
            module[1].bias[0] += 1e-7  # one bit of one element is enough
    check_weight_replicas([model])


def test_a_drifted_replica_is_named():
    run_on_ranks(drifted_on_rank, 2, False, timeout=120)
    with pytest.raises(
        RankFailure,
        match=r"rank 0: 1 parameters differ .*: 1\.bias \(ranks \[1\] differ from rank 0\)",
    ):
        run_on_ranks(drifted_on_rank, 2, True, timeout=120)


def test_the_loop_checks_at_the_interval(tmp_path):
    argv = tiny_options(tmp_path, "--check-weight-hash-across-dp-replicas-interval", "2")
    printed = "".join(run_on_ranks(train_printed_on_rank, 2, argv, timeout=300))
    assert printed.count("weight hashes match across data-parallel replicas") == 2, printed
    assert "after 2 iterations" in printed and "after 4 iterations" in printed
    fsdp = [*argv, "--use-megatron-fsdp"]
    with pytest.raises(RankFailure, match="no replicas to compare"):
        run_on_ranks(train_printed_on_rank, 2, fsdp, timeout=300)
