"""--calculate-per-token-loss: the loss is the global batch's mean over its loss tokens.

Each rank's loss is a sum over its tokens, the gradients are summed over data-parallel
ranks and divided once by the global batch's token count. So a data-parallel run takes
the steps of a one-rank run (the same losses and gradient norms), and when every
micro-batch holds as many loss tokens as the others, the steps of a run without the flag
(the mean of the micro-batches' means is then the mean over the batch's tokens): also
with a multi-token prediction layer and MoE layers, whose losses are scaled back by the
tokens the step divides by, at CP2 (each rank's own sum and count) and EP2.
"""

from pathlib import Path

import pytest

from mp_gpt.testing import (
    LOGGED_MOE,
    assert_same_curve,
    metrics_records,
    tiny_moe_options,
    tiny_options,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

LOGGED = ("lm loss", "grad_norm")


def run(tmp_path: Path, name: str, ranks: int, *extra: str, options=tiny_options) -> list[dict]:
    run_dir = tmp_path / name
    run_on_ranks(train_on_rank, ranks, options(run_dir, *extra), timeout=300)
    return metrics_records(run_dir)


def test_data_parallel_ranks_take_the_one_rank_steps(tmp_path):
    # EOD tokens masked out of the loss: the micro-batches hold different token counts
    flags = ("--calculate-per-token-loss", "--eod-mask-loss")
    one = run(tmp_path, "dp1", 1, *flags)
    two = run(tmp_path, "dp2", 2, *flags)
    assert_same_curve(two, one, LOGGED, "per-token loss, DP2 against DP1")


def test_equal_token_counts_give_the_mean_loss_steps(tmp_path):
    per_token = run(tmp_path, "per_token", 2, "--calculate-per-token-loss")
    mean = run(tmp_path, "mean", 2)
    assert_same_curve(per_token, mean, LOGGED, "per-token loss against the mean loss")


def test_mtp_and_moe_losses_keep_their_weight_at_cp2(tmp_path):
    """The routers' losses (a load-balancing coefficient of 0.1 and the z-loss, so that
    their gradients show in the norm) and the MTP loss weigh in the per-token run at CP2 x
    EP2 as in the mean run on one rank."""
    model = ("--mtp-num-layers", "1", "--moe-aux-loss-coeff", "0.1")
    layout = ("--context-parallel-size", "2", "--expert-model-parallel-size", "2")
    per_token = run(tmp_path, "per_token", 2, *model, *layout, "--calculate-per-token-loss",
                    options=tiny_moe_options)  # fmt: skip
    mean = run(tmp_path, "mean", 1, *model, options=tiny_moe_options)
    logged = (*LOGGED_MOE, "mtp_1 loss")
    assert_same_curve(per_token, mean, logged, "per-token loss at CP2 x EP2, mean on one rank")


def test_per_token_loss_refuses_averaging_in_the_collective():
    from mp_optim import OptimizerConfig

    with pytest.raises(ValueError, match="choose one"):
        OptimizerConfig(calculate_per_token_loss=True, average_in_collective=True)
