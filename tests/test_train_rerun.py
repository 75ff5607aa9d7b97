"""Result validation through the real loop (--rerun-mode, Megatron-LM's rerun engine):
apps/gpt's tiny config on two ranks, with dropout, so that a rerun that drew other random
numbers or read other data would show.

- a real nan loss (a learning rate of 1e12) from the second iteration is run again, found
  reproducible, saved (the iteration before, marked) and the run exits with 16; resumed
  on "other hardware" (the rank's name for it replaced) the rerun finds the same nan: a
  correct result, exit 17; resumed on the same hardware: 16 again;
- an injected persistent fault at PP2 takes the same path to "a persistent fault", and its
  checkpoint resumed with --rerun-mode disabled trains on exactly as the run that never
  failed (the checkpoint holds the iteration's starting random states and samples);
- an injected transient fault at TP2 ends with 17 and saves nothing;
- report_stats trains exactly as a run without reruns and logs the agreement;
- a spike (injected) is logged and training goes on;
- --iterations-to-skip, and the tracker file's repeated failures, drop their batches;
- with the gradient checks, a real nan gradient and an injected one take the same paths,
  and report_stats compares the bucket norms.
"""

from pathlib import Path

import pytest
import torch

from mp_ckpt import read_tracker
from mp_gpt.testing import metrics_records, tiny_options, train_output_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
DIVERGING = ["--lr", "1e12", "--min-lr", "0", "--lr-warmup-iters", "0", "--clip-grad", "0"]


def train_on(argv: list[str], elsewhere: bool = False) -> tuple[int, str]:
    """One rank's (exit status, printed text); `elsewhere`: the rank's hardware is named
    otherwise than where the checkpoint was saved."""
    if elsewhere:
        from mp_train.loop import rerun

        rerun.hardware = lambda device: ("another-node", "cuda:7")
    return train_output_on_rank(argv)


def run(argv: list[str], ranks: int = 2, elsewhere: bool = False) -> tuple[set, str]:
    results = run_on_ranks(train_on, ranks, argv, elsewhere, timeout=300)
    return {status for status, _ in results}, "".join(text for _, text in results)


def pending(save: Path) -> dict | None:
    directory = save / f"iter_{read_tracker(save):07d}"
    return torch.load(directory / "common.pt", weights_only=False).get("rerun")


def test_a_real_nan_is_saved_for_other_hardware_which_finds_it_correct(tmp_path):
    save = tmp_path / "ck"
    options = tiny_options(tmp_path / "run", *DROPOUT, *DIVERGING,
                           "--save", str(save), "--load", str(save))  # fmt: skip
    statuses, text = run(options)
    assert statuses == {16}, text
    assert "iteration 2: micro-batch 1: loss nan failed the nan loss check" in text
    assert "reproducible on this hardware" in text
    assert read_tracker(save) == 1 and pending(save) == {"iteration": 2,
                                                         "mode": "validate_results"}  # fmt: skip
    statuses, text = run(options)
    assert statuses == {16} and "resumed on the hardware that reproduced" in text
    statuses, text = run(options, elsewhere=True)
    assert statuses == {17} and "a correct result (the data or the model" in text


def test_a_persistent_fault_is_found_and_its_checkpoint_resumes_exactly(tmp_path):
    layout = [*DROPOUT, "--pipeline-model-parallel-size", "2"]
    run(tiny_options(tmp_path / "whole", *layout, "--rerun-mode", "disabled"))
    save = tmp_path / "ck"
    ckpt = ["--save", str(save), "--load", str(save), "--async-save"]  # committed before exit
    faulty = tiny_options(tmp_path / "faulty", *layout, *ckpt, "--error-injection-rate", "1",
                          "--error-injection-type", "persistent_error")  # fmt: skip
    statuses, text = run(faulty)
    assert statuses == {16} and "(injected)" in text and pending(save)["iteration"] == 2
    statuses, text = run(faulty, elsewhere=True)
    assert statuses == {17} and "computed wrongly, a persistent fault" in text
    resumed = tmp_path / "resumed"
    statuses, text = run(tiny_options(resumed, *layout, *ckpt, "--rerun-mode", "disabled"))
    assert statuses == {0} and "training goes on without it" in text
    whole = metrics_records(tmp_path / "whole")
    assert [r["lm loss"] for r in metrics_records(resumed)] == [r["lm loss"] for r in whole[1:]]


def test_a_transient_fault_ends_the_run_without_a_save(tmp_path):
    save = tmp_path / "ck"
    options = tiny_options(tmp_path, *DROPOUT, "--tensor-model-parallel-size", "2",
                           "--save", str(save), "--error-injection-rate", "1")  # fmt: skip
    statuses, text = run(options)
    assert statuses == {17} and "a transient fault" in text
    assert read_tracker(save) is None
    assert [r["iteration"] for r in metrics_records(tmp_path)] == [1]


def test_report_stats_trains_as_without_reruns_and_logs_the_agreement(tmp_path):
    layout = [*DROPOUT, "--tensor-model-parallel-size", "2"]
    run(tiny_options(tmp_path / "plain", *layout, "--rerun-mode", "disabled"))
    statuses, text = run(tiny_options(tmp_path / "twice", *layout, "--rerun-mode",
                                      "report_stats"))  # fmt: skip
    assert statuses == {0}
    assert "determinism after iteration 4 (every iteration run twice), the micro-batch " \
        "losses of every rank: 32 compared, all identical" in text  # fmt: skip
    plain, twice = metrics_records(tmp_path / "plain"), metrics_records(tmp_path / "twice")
    assert [r["lm loss"] for r in twice] == [r["lm loss"] for r in plain]


def test_a_spike_is_logged_and_training_goes_on(tmp_path):
    statuses, text = run(tiny_options(tmp_path, "--no-check-for-nan-in-loss-and-grad",
                                      "--check-for-spiky-loss", "--error-injection-rate", "1",
                                      "--error-injection-type", "correct_result"))  # fmt: skip
    assert statuses == {0}
    assert "failed the spiky loss check (injected)" in text
    assert "the failed check is not fatal: training goes on" in text
    assert [r["iteration"] for r in metrics_records(tmp_path)] == [1, 2, 3, 4]


def test_skipped_iterations_drop_their_batch(tmp_path):
    run(tiny_options(tmp_path / "all"))
    statuses, text = run(tiny_options(tmp_path / "given",
                                      "--iterations-to-skip", "2"))  # fmt: skip
    assert statuses == {0} and "iteration 2 skipped (iterations_to_skip)" in text
    tracker = tmp_path / "rejected.txt"
    tracker.write_text("".join(
        f"ts=2026-12-05 10:00:00 node=n device=cpu jobID={job} rank=1 iteration=3 "
        "status=rerun_disabled result=nan message='nan loss'\n" for job in (1, 2)
    ))  # fmt: skip
    tracked_options = ["--result-rejected-tracker-filename", str(tracker)]
    statuses, text = run(tiny_options(tmp_path / "tracked", *tracked_options))
    assert statuses == {0} and "iterations [3] failed their checks repeatably" in text
    every, given = metrics_records(tmp_path / "all"), metrics_records(tmp_path / "given")
    tracked = metrics_records(tmp_path / "tracked")
    assert [(r["iteration"], r["consumed_samples"]) for r in given] == [(1, 4), (3, 12), (4, 16)]
    assert [r["iteration"] for r in tracked] == [1, 2, 4]
    assert given[0]["lm loss"] == every[0]["lm loss"]
    # the schedule did not advance over the skipped batch
    assert given[1]["lr"] == every[1]["lr"] and tracked[2]["lr"] == every[2]["lr"]


GRADS_ONLY = ["--no-check-for-nan-in-loss-and-grad", "--check-for-nan-in-grad"]


def test_a_nan_gradient_is_run_again_under_ddp(tmp_path):
    """Only the gradients checked: the diverging run's nan comes back in the rerun's
    bucket norm (no save directory: exit 17); an injected transient one does not."""
    statuses, text = run(tiny_options(tmp_path / "real", *DIVERGING, *GRADS_ONLY))
    assert statuses == {17}, text
    assert "bucket 0: gradient norm nan failed the nan grads check" in text
    assert "without a save directory" in text
    statuses, text = run(tiny_options(tmp_path / "injected", *GRADS_ONLY, "--overlap-grad-reduce",
                                      "--error-injection-rate", "1"))  # fmt: skip
    assert statuses == {17} and "failed the nan grads check (injected)" in text
    assert "a transient fault" in text


def test_report_stats_compares_the_gradient_norms(tmp_path):
    checks = ["--check-for-nan-in-grad", "--check-for-large-grads"]
    statuses, text = run(tiny_options(tmp_path, "--rerun-mode", "report_stats", *checks))
    assert statuses == {0}
    assert "the gradient buckets' norms of every rank: 4 compared, all identical" in text
