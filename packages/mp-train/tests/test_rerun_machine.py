"""The rerun engine (mp_train.loop.rerun) driven by a scripted step on one gloo rank: which
iterations run twice, with what data and random draws, and how each verdict ends the
run, checkpoint state and tracker lines included. The training loop's side is
tests/test_train_rerun.py."""

import math

import pytest
import torch

from mp_state.testing import run_on_ranks
from mp_train.configuration.config import TrainingConfig
from mp_train.loop import rerun
from mp_train.loop.rerun import RerunMachine

pytestmark = pytest.mark.multirank

NAN = math.nan


def machine(can_save: bool = True, nan_grads: bool = False, large_grads: bool = False,
            **fields) -> RerunMachine:  # fmt: skip
    return RerunMachine(TrainingConfig(**fields), 0, torch.device("cpu"), None, can_save,
                        nan_grads=nan_grads, large_grads=large_grads)  # fmt: skip


def iteration(engine: RerunMachine, number: int, script: list[list[float]], data=None) -> list:
    """Runs iteration `number` as the loop would: attempt k's micro-batch losses are
    script[k - 1]. Returns, per attempt, the (item read, random draw) of each micro-batch."""
    runs = []
    for attempt in engine.attempts(number):
        losses, seen = script[attempt.number - 1], []

        def forward(data_iterator, model, losses=losses, seen=seen):
            seen.append((next(data_iterator) if data_iterator is not None else None,
                         torch.rand(()).item()))  # fmt: skip
            value = losses[len(seen) - 1]
            return None, lambda output: (torch.tensor(value), torch.tensor(1.0), {})

        step = attempt.watch(forward) if engine.watching else forward
        for _ in losses:
            output, loss_func = step(data, None)
            loss_func(output)
        runs.append(seen)
    return runs


def validating(tracker: str) -> dict:
    engine = machine(result_rejected_tracker_filename=tracker)
    data = engine.wrap(iter(range(100)))
    out = {"first": iteration(engine, 1, [[NAN, 1.0]], data), "first_exit": engine.exit}
    out["clean"] = iteration(engine, 2, [[1.0, 2.0]], data)
    out["failed"] = iteration(engine, 3, [[1.0, NAN], [1.0, NAN]], data)
    out["exit"] = engine.exit
    out["state"] = engine.saved_state()
    return out


def test_a_failed_loss_reruns_the_iteration_with_its_data_and_draws(tmp_path):
    tracker = tmp_path / "rejected.txt"
    (out,) = run_on_ranks(validating, 1, str(tracker))
    assert len(out["first"]) == 1 and out["first_exit"] is None  # the first is not validated
    assert len(out["clean"]) == 1
    first, second = out["failed"]
    assert first == second  # the same items and the same random draws
    assert [item for item, _ in first] == [4, 5]  # after the first iterations' 0..3
    assert out["exit"].code == rerun.EXIT_RESUME_ELSEWHERE and out["exit"].save
    common, mine = out["state"]
    assert common == {"iteration": 3, "mode": "validate_results"}
    failure = mine["failure"]
    assert (failure["check"], failure["where"], failure["fatal"]) == ("nan loss", "micro-batch 2",
                                                                       True)  # fmt: skip
    assert math.isnan(failure["result"]) and mine["injected"] is None
    statuses = [line.split(" status=")[1].split()[0] for line in tracker.read_text().splitlines()]
    # the first iteration's nan, not validated (reruns start at the second), is recorded
    assert statuses == ["rerun_disabled", "initial_run", "first_rerun_reproducible"]


def verdicts() -> dict:
    out = {}
    transient = machine()
    iteration(transient, 1, [[1.0]])
    iteration(transient, 2, [[math.inf], [3.0]])
    out["transient"] = transient.exit
    unsaved = machine(can_save=False)
    iteration(unsaved, 1, [[1.0]])
    iteration(unsaved, 2, [[NAN], [NAN]])
    out["unsaved"] = unsaved.exit
    spiky = machine(check_for_spiky_loss=True)
    spiky.checks["loss"][-1].detector.samples = 2
    for number, losses in enumerate([[1.0], [1.0], [2.0]], start=1):
        iteration(spiky, number, [losses])
    out["spike_runs"] = len(iteration(spiky, 4, [[50.0], [50.0]]))
    out["spike_exit"] = spiky.exit
    out["after_spike"] = len(iteration(spiky, 5, [[2.0]]))
    return out


def test_how_each_first_verdict_ends():
    (out,) = run_on_ranks(verdicts, 1)
    assert out["transient"].code == rerun.EXIT_VALIDATION_FAILED and not out["transient"].save
    assert "transient" in out["transient"].reason
    assert out["unsaved"].code == rerun.EXIT_VALIDATION_FAILED and not out["unsaved"].save
    assert "without a save directory" in out["unsaved"].reason
    # a spike is run again and training goes on
    assert out["spike_runs"] == 2 and out["spike_exit"] is None and out["after_spike"] == 1


def from_checkpoint(saved: tuple, elsewhere: bool, second_loss: float, tracker: str):
    if elsewhere:
        rerun.hardware = lambda device: ("another-node", "cuda:3")
    engine = machine(result_rejected_tracker_filename=tracker)
    engine.load_state(*saved)
    runs = iteration(engine, 3, [[1.0, second_loss]])
    return len(runs), engine.exit


def test_the_rerun_from_a_checkpoint_tells_hardware_from_result(tmp_path):
    tracker = tmp_path / "rejected.txt"
    (out,) = run_on_ranks(validating, 1, str(tracker))
    saved = out["state"]
    runs, same_node = run_on_ranks(from_checkpoint, 1, saved, False, NAN, str(tracker))[0]
    assert runs == 1 and same_node.code == rerun.EXIT_RESUME_ELSEWHERE and not same_node.save
    _, correct = run_on_ranks(from_checkpoint, 1, saved, True, NAN, str(tracker))[0]
    _, faulty = run_on_ranks(from_checkpoint, 1, saved, True, 2.5, str(tracker))[0]
    assert correct.code == faulty.code == rerun.EXIT_VALIDATION_FAILED
    statuses = [line.split(" status=")[1].split()[0] for line in tracker.read_text().splitlines()]
    assert statuses[3:] == ["second_rerun_reproducible", "second_rerun_not_reproducible"]


def injected(kind: str) -> list:
    engine = machine(error_injection_rate=1, error_injection_type=kind)
    iteration(engine, 1, [[1.0]])
    iteration(engine, 2, [[1.0], [1.0]])
    first = engine.exit
    if first.code != rerun.EXIT_RESUME_ELSEWHERE:
        return [first.code]
    saved = engine.saved_state()
    rerun.hardware = lambda device: ("another-node", "cuda:3")
    again = machine(error_injection_rate=1, error_injection_type=kind)
    again.load_state(*saved)
    iteration(again, 2, [[1.0]])
    return [first.code, again.exit.code, saved[1]["injected"]]


@pytest.mark.parametrize("kind", ["transient_error", "persistent_error", "correct_result"])
def test_an_injected_failure_takes_its_kind_of_path(kind):
    (codes,) = run_on_ranks(injected, 1, kind)
    if kind == "transient_error":
        assert codes == [rerun.EXIT_VALIDATION_FAILED]
    else:
        assert codes == [rerun.EXIT_RESUME_ELSEWHERE, rerun.EXIT_VALIDATION_FAILED, kind]


def other_modes(tracker: str) -> dict:
    stats = machine(rerun_mode="report_stats")
    data = stats.wrap(iter(range(100)))
    runs = iteration(stats, 1, [[1.0, 2.0], [1.0, 2.5]], data)
    disabled = machine(rerun_mode="disabled", result_rejected_tracker_filename=tracker)
    plain = iteration(disabled, 1, [[1.0]]) + iteration(disabled, 2, [[NAN]])
    return {
        "stats_runs": runs,
        "stats": stats.stats,
        "disabled_runs": len(plain),
        "disabled_exit": disabled.exit,
        "unwrapped": disabled.wrap(data) is data,
    }


def test_report_stats_runs_every_iteration_twice_and_disabled_once(tmp_path):
    tracker = tmp_path / "rejected.txt"
    (out,) = run_on_ranks(other_modes, 1, str(tracker))
    first, second = out["stats_runs"]
    assert first == second
    assert out["stats"] == {"loss": [0.0, pytest.approx(0.5 / 2.25)], "grads": []}
    assert out["disabled_runs"] == 2 and out["disabled_exit"] is None and out["unwrapped"]
    assert " iteration=2 status=rerun_disabled result=nan " in tracker.read_text()


def pending_elsewhere() -> str:
    engine = machine()
    try:
        engine.load_state({"iteration": 3, "mode": "validate_results"}, None)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_a_pending_rerun_needs_its_layout():
    (message,) = run_on_ranks(pending_elsewhere, 1)
    assert "load it with the layout it was saved with" in message
    assert "--rerun-mode disabled" in message


def disagreeing() -> tuple:
    """Rank 0's nan does not come back (transient), rank 1's does (reproducible)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    engine = RerunMachine(TrainingConfig(), rank, torch.device("cpu"), None, True)
    iteration(engine, 1, [[1.0]])
    iteration(engine, 2, [[NAN], [1.5 if rank == 0 else NAN]])
    return engine.exit.code, engine.saved_state()[1]["failure"]


def test_a_reproducible_failure_on_one_rank_outranks_a_transient_one_on_another():
    (code0, kept0), (code1, kept1) = run_on_ranks(disagreeing, 2)
    assert code0 == code1 == rerun.EXIT_RESUME_ELSEWHERE
    assert kept0 is None  # rank 0's transient failure is not rerun elsewhere
    assert kept1["check"] == "nan loss" and kept1["where"] == "micro-batch 1"


def gradients(engine: RerunMachine, number: int, script: list[list[float]]) -> int:
    """Runs iteration `number` whose attempt k reports bucket norms script[k - 1] (one
    gradient element each); returns how many runs it took."""
    runs = 0
    for attempt in engine.attempts(number):
        for bucket, norm in enumerate(script[attempt.number - 1]):
            attempt.gradient(0, bucket, torch.tensor([norm]))
        runs += 1
    return runs


def gradient_checks() -> dict:
    out = {}
    first = machine(nan_grads=True)
    try:
        gradients(first, 1, [[1.0, NAN]])
    except FloatingPointError as error:  # the first iteration: no rerun, the run stops
        out["first"] = str(error)
    nan = machine(nan_grads=True)
    gradients(nan, 1, [[1.0, 1.0]])
    out["nan_runs"] = gradients(nan, 2, [[1.0, NAN], [1.0, NAN]])
    out["nan_exit"], out["nan_failure"] = nan.exit, nan.saved_state()[1]["failure"]
    large = machine(large_grads=True)
    large.checks["grads"][-1].detector.samples = 2
    gradients(large, 1, [[1.0, 2.0]])
    # 100 > 10 x 2: run again; 100.05 is within 0.1% of it, the same result: not fatal
    out["large_runs"] = gradients(large, 2, [[100.0, 1.0], [100.05, 1.0]])
    out["large_exit"] = large.exit
    disabled = machine(rerun_mode="disabled", nan_grads=True, large_grads=True)
    out["disabled_checks"] = [c.name for c in disabled.checks["grads"]]
    return out


def test_gradient_norms_are_validated_with_a_tolerance():
    (out,) = run_on_ranks(gradient_checks, 1)
    assert out["first"] == ("rank 0: iteration 1: chunk 0 bucket 1: gradient norm nan failed "
                            "the nan grads check (before the data-parallel reduction)")  # fmt: skip
    assert out["nan_runs"] == 2 and out["nan_exit"].code == rerun.EXIT_RESUME_ELSEWHERE
    assert out["nan_failure"]["where"] == "chunk 0 bucket 1"
    assert out["nan_failure"]["kind"] == "grads" and out["nan_failure"]["check"] == "nan grads"
    assert out["large_runs"] == 2 and out["large_exit"] is None
    # with reruns disabled DDP raises on a nan gradient itself: only large ones are checked
    assert out["disabled_checks"] == ["large grads"]


def warnings_on_load(rng_restored: bool) -> list[str]:
    import logging

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("mp_train").addHandler(handler)
    mine = {"failure": None, "hardware": ["n", "cpu"], "injected": None}
    machine().load_state({"iteration": 3, "mode": "validate_results"}, mine,
                         rng_restored=rng_restored)  # fmt: skip
    return seen


def test_a_rerun_without_its_random_states_says_so():
    (without,) = run_on_ranks(warnings_on_load, 1, False)
    (with_them,) = run_on_ranks(warnings_on_load, 1, True)
    assert any("the saved random states were not taken back" in m for m in without)
    assert not any("random states" in m for m in with_them)


def nothing_to_check() -> tuple:
    engine = machine(check_for_nan_in_loss_and_grad=False)
    data = iter(range(10))
    runs = iteration(engine, 1, [[1.0]]) + iteration(engine, 2, [[NAN]])
    return len(runs), engine.wrap(data) is data, engine.exit


def test_validation_with_nothing_to_check_runs_each_iteration_once():
    (out,) = run_on_ranks(nothing_to_check, 1)
    assert out == (2, True, None)
