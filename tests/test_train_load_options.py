"""What a resume takes from a checkpoint under Megatron-LM's load options, end to end on
the tiny model: --no-load-optim starts the learning-rate scheduler anew with the optimizer
(Megatron-LM loads the two together), a checkpoint saved with --no-save-optim needs
--no-load-optim, and a --load that holds nothing, or none at all, starts from scratch."""

import re

import pytest

from mp_gpt.testing import tiny_curve, tiny_options, train_on_rank, train_output_on_rank
from mp_state.testing import RankFailure, run_on_ranks
from mp_train import parse_config
from mp_train.loop.starting_point import starting_point

pytestmark = pytest.mark.multirank

# Warm-up over 2 iterations, so that a scheduler started anew is told apart.
WARMUP = ["--lr-warmup-iters", "2", "--train-iters", "6"]


def test_no_load_optim_starts_the_scheduler_anew(tmp_path):
    save = tmp_path / "ckpt"
    first = tiny_curve(tmp_path / "first", 1, *WARMUP, "--save", str(save),
                       "--save-interval", "3", "--exit-interval", "3")  # fmt: skip
    resumed = tiny_curve(tmp_path / "resumed", 1, *WARMUP, "--load", str(save))
    fresh = tiny_curve(tmp_path / "fresh", 1, *WARMUP, "--load", str(save), "--no-load-optim")
    # Both continue at iteration 4 with the samples consumed so far.
    assert [r["iteration"] for r in fresh] == [r["iteration"] for r in resumed] == [4, 5, 6]
    assert fresh[0]["consumed_samples"] == resumed[0]["consumed_samples"]
    # The resumed schedule goes on past its warm-up; the fresh one warms up again, as the
    # first run's first iterations did.
    assert [r["lr"] for r in fresh[:2]] == [r["lr"] for r in first[:2]]
    assert resumed[0]["lr"] != first[0]["lr"]


def test_a_checkpoint_without_optimizer_state_needs_no_load_optim(tmp_path):
    save = tmp_path / "ckpt"
    tiny_curve(tmp_path / "first", 1, "--train-iters", "2", "--save", str(save),
               "--no-save-optim")  # fmt: skip
    argv = tiny_options(tmp_path / "again", "--train-iters", "4", "--load", str(save))
    said = f"{save}/iter_0000002 holds no optimizer state (saved with no_save_optim): load it "
    with pytest.raises(RankFailure, match=re.escape(said + "with --no-load-optim or --finetune")):
        run_on_ranks(train_on_rank, 1, argv, timeout=120)
    assert [r["iteration"] for r in tiny_curve(
        tmp_path / "third", 1, "--train-iters", "4", "--load", str(save), "--no-load-optim")
    ] == [3, 4]  # fmt: skip


def test_nothing_to_load_starts_from_scratch(tmp_path):
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    folder = tmp_path / "np"
    tiny_curve(tmp_path / "first", 1, "--train-iters", "3", "--save", str(tmp_path / "ckpt"),
               "--non-persistent-save-interval", "3", "--non-persistent-ckpt-type", "global",
               "--non-persistent-global-ckpt-dir", str(folder))  # fmt: skip
    global_dir = ["--non-persistent-ckpt-type", "global",
                  "--non-persistent-global-ckpt-dir", str(folder)]  # fmt: skip

    def start(*flags: str):
        return starting_point(parse_config([*model, *flags], environ={"RANK": "1"}).checkpoint)

    # The folder holds iteration 3; a run with load resumes from it (the newer), one
    # without load and pretrained_checkpoint starts anew (Megatron-LM loads nothing).
    assert start("--load", str(tmp_path / "empty"), *global_dir) == (str(folder), False)
    assert start(*global_dir) is None
    # An empty load: from scratch, with a warning.
    argv = tiny_options(tmp_path / "scratch", "--train-iters", "2", "--load",
                        str(tmp_path / "empty"))  # fmt: skip
    status, said = run_on_ranks(train_output_on_rank, 1, argv, timeout=120)[0]
    assert status == 0
    assert f"load={tmp_path / 'empty'} holds no checkpoint: training starts from scratch" in said


def test_a_fine_tuning_start_needs_every_tensor_its_model_asks_for(tmp_path):
    """--finetune (or --no-load-optim) passes over saved tensors the model does not ask
    for, and refuses a model whose tensors the checkpoint lacks, as Megatron-LM's default
    assume_ok_unexpected: multi-token prediction modules are not left at their random
    draw."""
    save = tmp_path / "ckpt"
    tiny_curve(tmp_path / "first", 1, "--train-iters", "2", "--save", str(save))
    argv = tiny_options(tmp_path / "mtp", "--train-iters", "2", "--load", str(save),
                        "--finetune", "--mtp-num-layers", "1")  # fmt: skip
    with pytest.raises(RankFailure, match=r"missing keys \['mtp\.layers\.0\."):
        run_on_ranks(train_on_rank, 1, argv, timeout=120)
    # The other way round, a checkpoint with the modules fine-tunes a model without them.
    with_mtp = tmp_path / "with_mtp"
    tiny_curve(tmp_path / "second", 1, "--train-iters", "2", "--save", str(with_mtp),
               "--mtp-num-layers", "1")  # fmt: skip
    again = tiny_curve(tmp_path / "again", 1, "--train-iters", "2", "--load", str(with_mtp),
                       "--finetune")  # fmt: skip
    assert [r["iteration"] for r in again] == [1, 2]
