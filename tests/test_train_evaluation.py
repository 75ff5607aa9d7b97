"""Evaluation runs and reports what it measured; with eval_iters=0 there is none (Megatron's
do_valid and do_test), and no empty "validation |" line. The test split (mock data has
one) is evaluated once, at the end, from its start. An evaluation leaves the training
curve as it was."""

from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK, train_printed_on_rank
from mp_state.testing import run_on_ranks

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"
ARGV = [
    "--config", str(CONFIG), "--mock-data", *GIVEN_PEAK, "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000", "--seq-length", "32", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", "4", "--eval-interval", "2",
    "--save", "none", "--load", "none", "--tensorboard-dir", "none", "--num-workers", "0",
    "--log-interval", "100", "--lr-warmup-iters", "0",
]  # fmt: skip


def body(argv):
    """The evaluation lines of a run: validation's and the test split's."""
    return [line for line in train_printed_on_rank(argv).splitlines()
            if "validation" in line or line.startswith("test at")]  # fmt: skip


@pytest.mark.multirank
def test_validation_lines_carry_the_loss():
    lines = run_on_ranks(body, 1, [*ARGV, "--eval-iters", "1"], timeout=120)[0]
    assert [line.split(" | ")[0] for line in lines] == [
        "validation at iteration 2",
        "final validation",  # the last iteration's evaluation is the final one
        "test at iteration 4",  # Megatron's "iteration 4 on test set"
    ]
    assert all(" | lm loss " in line for line in lines)
    assert len({line.split(" | lm loss ")[1] for line in lines}) == 3  # three losses


@pytest.mark.multirank
def test_eval_iters_zero_evaluates_nothing():
    assert run_on_ranks(body, 1, [*ARGV, "--eval-iters", "0"], timeout=120)[0] == []


def validation_losses(ranks: int, *extra: str) -> list[float]:
    """The validation and test losses a run prints (on its last rank), 4 samples a batch."""
    argv = [*ARGV, "--eval-iters", "2", "--global-batch-size", "4", "--micro-batch-size", "1"]
    lines = run_on_ranks(body, ranks, [*argv, *extra], timeout=120)[-1]
    return [float(line.split(" | lm loss ")[1].split(" | ")[0]) for line in lines]


@pytest.mark.multirank
def test_every_data_parallel_size_evaluates_the_same_samples():
    """The validation split is read in the training's order ("single": in order), as in
    Megatron-LM: one rank and two report the same validation losses. Read shuffled per
    data-parallel bucket, as it was, two ranks evaluated other samples (6.936 against 6.926)."""
    one = validation_losses(1)
    assert len(one) == 3  # two validations, the test split
    assert validation_losses(2) == pytest.approx(one, rel=1e-5)


@pytest.mark.multirank
def test_virtual_pipeline_stages_evaluate_on_ranks_that_read_no_data():
    """With virtual stages each model chunk takes an iterator; the ranks that read no data
    (tensor-parallel ranks > 0) took none at all for validation, and the first evaluation
    of a TP2 x PP2 x VPP2 run failed there (the others waited for them)."""
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1"]  # fmt: skip
    assert validation_losses(4, *layout) == pytest.approx(validation_losses(1), rel=1e-5)


def evaluation_steps(argv) -> tuple[int, int]:
    """(the evaluation's forward steps, the validation samples consumed) of a run."""
    import mp_gpt.pretrain
    from mp_gpt.testing import train_run_on_rank

    real, steps = mp_gpt.pretrain.forward_step, []

    def counted(data_iterator, model, **kwargs):
        if not model.training:
            steps.append(1)
        return real(data_iterator, model, **kwargs)

    mp_gpt.pretrain.forward_step = counted
    run = train_run_on_rank(argv)
    return len(steps), run.train.consumed_valid_samples


@pytest.mark.multirank
def test_the_evaluation_batch_is_its_own():
    """Two evaluations (iterations 2 and 4) of one iteration each: --eval-global-batch-size 4
    reads 8 samples, in 8 micro-batches of --eval-micro-batch-size 1 or 4 of the training's
    2; without them, the training's batch (2 samples, one micro-batch)."""
    four = [*ARGV, "--eval-iters", "1", "--eval-global-batch-size", "4"]
    by_one = run_on_ranks(evaluation_steps, 1, [*four, "--eval-micro-batch-size", "1"],
                          timeout=120)[0]  # fmt: skip
    # The test split's evaluation at the end reads one such batch more, and counts no
    # validation samples.
    assert by_one == (8 + 4, 8)
    assert run_on_ranks(evaluation_steps, 1, four, timeout=120)[0] == (4 + 2, 8)
    plain = run_on_ranks(evaluation_steps, 1, [*ARGV, "--eval-iters", "1"], timeout=120)[0]
    assert plain == (2 + 1, 4)


def test_the_evaluation_batch_must_fit(monkeypatch, tmp_path):
    from mp_train import parse_config, validate

    monkeypatch.setenv("MP_RUN_DIR", str(tmp_path))
    for flags, message in (
        (["--eval-global-batch-size", "3"], "eval_global_batch_size=3 is not divisible by "
                                            "eval_micro_batch_size=2 x data_parallel_size=1"),
        (["--eval-micro-batch-size", "3"], "the global batch is not divisible"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            validate(parse_config([*ARGV, *flags]), 1)


@pytest.mark.multirank
def test_evaluation_starts_at_start_eval_at_iter():
    """--eval-interval 1 --start-eval-at-iter 3 over 5 iterations: validations at 3 and 4,
    the final one at 5 (Megatron's rule), and the validation samples built for those."""
    argv = [*ARGV, "--eval-iters", "1", "--eval-interval", "1", "--train-iters", "5",
            "--start-eval-at-iter", "3"]  # fmt: skip
    lines = run_on_ranks(body, 1, argv, timeout=120)[0]
    assert [line.split(" | ")[0] for line in lines] == [
        "validation at iteration 3",
        "validation at iteration 4",
        "final validation",
        "test at iteration 5",
    ]
    steps, consumed = run_on_ranks(evaluation_steps, 1, argv, timeout=120)[0]
    assert (steps, consumed) == (3 + 1, 6)


def collections_around_evaluations(argv) -> list:
    """The gc.collect calls of a run, in order, with an evaluation's start and end marked."""
    import gc

    import mp_train.loop.training as loop
    from mp_gpt.testing import train_printed_on_rank

    calls, real_collect, real_evaluate = [], gc.collect, loop.evaluate

    def collect(generation=2):
        calls.append(generation)
        return real_collect(generation)

    def evaluate(*args, **kwargs):
        calls.append("evaluate")
        return real_evaluate(*args, **kwargs)

    gc.collect, loop.evaluate = collect, evaluate
    try:
        train_printed_on_rank(argv)
    finally:
        gc.collect, loop.evaluate = real_collect, real_evaluate
    return calls


@pytest.mark.multirank
def test_manual_gc_collects_around_each_evaluation_unless_told_not_to():
    argv = [*ARGV, "--eval-iters", "1", "--manual-gc", "--eval-interval", "2"]
    calls = run_on_ranks(collections_around_evaluations, 1, argv, timeout=120)[0]
    # The collection at start, then Megatron's around the evaluation at iteration 2 (the
    # final one, after iteration 4, is outside the loop).
    assert calls[:4] == [2, 2, "evaluate", 0]
    calls = run_on_ranks(collections_around_evaluations, 1, [*argv, "--no-manual-gc-eval"],
                         timeout=120)[0]  # fmt: skip
    assert calls[:2] == [2, "evaluate"] and 0 not in calls


def iteration_lines(argv) -> list[str]:
    from mp_gpt.testing import train_printed_on_rank

    return [line for line in train_printed_on_rank(argv).splitlines()
            if line.startswith("iteration")]  # fmt: skip


@pytest.mark.multirank
def test_the_log_line_carries_the_device_memory_in_use_when_asked():
    argv = [*ARGV, "--eval-iters", "0", "--log-interval", "2"]
    plain = run_on_ranks(iteration_lines, 1, argv, timeout=120)[0]
    asked = run_on_ranks(iteration_lines, 1, [*argv, "--log-device-memory-used"],
                         timeout=120)[0]  # fmt: skip
    assert len(plain) == len(asked) == 2
    assert all("device memory used MB" not in line for line in plain)
    for line in asked:
        used = float(line.split("device memory used MB ")[1].split()[0])
        assert used > 0


def cut_evaluation(argv) -> tuple[list[str], int]:
    """(the lines a run printed about evaluating and exiting, its consumed validation
    samples)."""
    import contextlib
    import io

    from mp_gpt.testing import train_run_on_rank

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run = train_run_on_rank(argv)
    words = ("validation", "final validation", "evaluation", "test at", "exiting")
    lines = [line for line in out.getvalue().splitlines() if line.startswith(words)]
    return lines, run.train.consumed_valid_samples


@pytest.mark.multirank
def test_an_evaluation_stops_when_the_time_limit_passes():
    """As Megatron's: exit_duration_in_mins is checked after each evaluation batch, so a
    long evaluation does not keep the run from saving in time. Passed after the first
    iteration here: its evaluation stops after one of three batches, unreported, and
    the run exits there (no final or test evaluation). With time left, all three."""
    argv = [*ARGV, "--eval-iters", "3", "--eval-interval", "1", "--global-batch-size", "4"]
    lines, consumed = run_on_ranks(cut_evaluation, 2, [*argv, "--exit-duration-in-mins",
                                                       "1e-9"], timeout=120)[-1]  # fmt: skip
    assert lines == [
        "evaluation stopped at iteration 1: exit_duration_in_mins=1e-09 has passed",
        "exiting at iteration 1: exit_duration_in_mins=1e-09",
    ]
    assert consumed == 4  # one global batch
    lines, consumed = run_on_ranks(cut_evaluation, 2, [*argv, "--exit-duration-in-mins",
                                                       "1000"], timeout=120)[-1]  # fmt: skip
    assert [line.split(" | ")[0] for line in lines] == [
        "validation at iteration 1", "validation at iteration 2", "validation at iteration 3",
        "final validation", "test at iteration 4"]  # fmt: skip
    assert consumed == 4 * 3 * 4  # the three evaluations during training, the final one


def after_a_slow_start(argv) -> tuple[list[str], int]:
    """cut_evaluation, its rank having spent 3 s before training starts."""
    import time

    time.sleep(3)
    return cut_evaluation(argv)


@pytest.mark.multirank
def test_the_time_limit_counts_from_the_start_of_the_job():
    """As Megatron's: exit_duration_in_mins counts from the process's start (the earliest
    rank's), so that set-up counts against a scheduler's limit. A limit of 2.4 s has passed
    when training starts 3 s after the ranks did: the run stops after its first
    iteration, where counting from the loop's start let it train on."""
    argv = [*ARGV, "--train-iters", "1000", "--eval-interval", "none", "--global-batch-size", "4",
            "--exit-duration-in-mins", "0.04"]  # fmt: skip
    lines, _ = run_on_ranks(after_a_slow_start, 2, argv, timeout=120)[-1]
    assert lines == ["exiting at iteration 1: exit_duration_in_mins=0.04"]


def first_interval_ms(argv) -> float:
    """The ms/iteration of a run's first log line, its datasets' set-up, each evaluation
    and each save taking 1 s more."""
    import time

    import mp_train.loop.training as loop
    from mp_gpt.testing import train_printed_on_rank

    def slowly(function):
        def slow(*args, **kwargs):
            time.sleep(1.0)
            return function(*args, **kwargs)

        return slow

    for name in ("data_iterators", "evaluate", "save_run_checkpoint"):
        setattr(loop, name, slowly(getattr(loop, name)))
    lines = train_printed_on_rank(argv).splitlines()
    return float(next(line for line in lines if line.startswith("iteration ")).split(
        "ms/iteration ")[1].split()[0])  # fmt: skip


@pytest.mark.multirank
def test_the_log_lines_time_leaves_out_set_up_evaluations_and_saves(tmp_path):
    """As Megatron's interval timer: the first log line's interval starts with training,
    and an evaluation or a save inside an interval is not in its time (nor in tokens/s
    and MFU). The interval of iterations 1 and 2 holds 3 s of them (the set-up before,
    iteration 1's evaluation and save); counted in, they alone would make 1,500
    ms/iteration, where the tiny model's iterations take a few ms."""
    argv = [*ARGV, "--train-iters", "2", "--log-interval", "2", "--eval-interval", "1",
            "--eval-iters", "1", "--save", str(tmp_path), "--save-interval", "1"]  # fmt: skip
    assert run_on_ranks(first_interval_ms, 1, argv, timeout=120)[0] < 500


@pytest.mark.multirank
def test_evaluations_leave_the_training_curve_alone(tmp_path):
    # Dropout (eval mode must draw no random numbers) and the MoE router's expert bias
    # (updated from the tokens each expert got in training, not in evaluation): the
    # training losses and gradient norms with an evaluation after every iteration are
    # those without any, bitwise.
    from mp_gpt.testing import metrics_records, tiny_moe_options, train_on_rank

    flags = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1",
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", "0.01"]  # fmt: skip
    curves = []
    for name, evaluations in (("every", ["--eval-interval", "1", "--eval-iters", "2"]),
                              ("none", ["--eval-interval", "none"])):  # fmt: skip
        run_dir = tmp_path / name
        run_on_ranks(train_on_rank, 1, tiny_moe_options(run_dir, *flags, *evaluations),
                     timeout=120)  # fmt: skip
        curves.append([(r["lm loss"], r["grad_norm"]) for r in metrics_records(run_dir)])
    assert len(curves[0]) == 4
    assert curves[0] == curves[1]
