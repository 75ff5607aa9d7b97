"""The loop's components on their own, without ranks: the NaN/skip policy and the
eval/save/exit cadence."""

from types import SimpleNamespace

import pytest

from mp_ckpt import CheckpointConfig
from mp_train import TrainingConfig, TrainState
from mp_train.loop.cadence import Cadence, Due, Stop
from mp_train.loop.phases import phase_samples
from mp_train.loop.skip_policy import SkipPolicy

NAN, INF = float("nan"), float("inf")
UPDATED = SimpleNamespace(update_successful=True)
NOT_UPDATED = SimpleNamespace(update_successful=False)


def run_policy(training: TrainingConfig, iterations, other_ranks_bad=()):
    """Runs the policy over (losses, result of a step) per iteration, as the loop does;
    `other_ranks_bad`: iterations where another rank's loss was not finite. Returns the
    counters and, per iteration, (took a step, updated)."""
    counters, seen, asked = TrainState(), [], []

    def any_rank(flag: bool) -> bool:
        asked.append(flag)
        return flag or len(seen) + 1 in other_ranks_bad

    policy = SkipPolicy(training, counters, any_rank=any_rank)
    for losses, result in iterations:
        step = policy.takes_step(losses, counters.iteration + 1)
        counters.iteration += 1
        seen.append((step, policy.updated(result if step else None)))
    return counters, seen, asked


def test_skip_policy_counts_nan_and_skipped_iterations():
    good, bad = {"lm loss": 2.5}, {"lm loss": NAN, "z_loss": 0.1}
    skipping = TrainingConfig(skip_nan_loss_iterations=True)
    counters, seen, asked = run_policy(
        skipping,
        [(good, UPDATED), (bad, UPDATED), (good, NOT_UPDATED), ({"lm loss": INF}, UPDATED),
         ({}, UPDATED), (good, UPDATED)],
        other_ranks_bad={5},
    )  # fmt: skip
    assert seen == [(True, True), (False, False), (True, False), (False, False),
                    (False, False), (True, True)]  # fmt: skip
    assert (counters.nan_iterations, counters.skipped_iterations) == (3, 4)
    assert asked == [False, True, False, True, False, False]  # each rank's own flag
    # Checking and stopping (the default): the error names the rank, its losses, the iteration.
    with pytest.raises(FloatingPointError, match=r"rank 0: loss \{'lm loss': nan.* iteration 2 "):
        run_policy(TrainingConfig(), [(good, UPDATED), (bad, UPDATED)])
    with pytest.raises(FloatingPointError, match="rank 0: a rank of the last pipeline stage"):
        run_policy(TrainingConfig(), [({}, UPDATED)], other_ranks_bad={1})
    # Not checking: no collective, a nan loss steps; only a failed update is skipped.
    unchecked = TrainingConfig(check_for_nan_in_loss_and_grad=False)
    counters, seen, asked = run_policy(unchecked, [(bad, UPDATED), (bad, NOT_UPDATED)])
    assert seen == [(True, True), (True, False)] and asked == []
    assert (counters.nan_iterations, counters.skipped_iterations) == (0, 1)


def cadence_of(valid=True, signal_at=(), minutes=lambda it: 0.0, save=None, save_interval=None,
               test=False, **training) -> tuple[Cadence, TrainState]:  # fmt: skip
    """A cadence over `training` (train_iters 10 unless given) whose SIGTERM arrives at the
    iterations `signal_at` and whose clock says minutes(iteration)."""
    training.setdefault("train_iters", 10)
    checkpoint = CheckpointConfig(save=save, save_interval=save_interval)
    train = TrainState()
    cadence = Cadence(TrainingConfig(**training), checkpoint, valid, has_test_data=test,
                      signal_received=lambda: train.iteration in signal_at,
                      minutes_elapsed=lambda: minutes(train.iteration))  # fmt: skip
    return cadence, train


def decisions(cadence: Cadence, train: TrainState, samples: int = 1) -> dict[int, tuple]:
    """Runs the cadence as the loop does; per iteration where something is due or the run
    stops, (evaluate, save, collect garbage, why it stops, saves before stopping)."""
    out = {}
    while not cadence.finished(train):
        train.iteration += 1
        train.consumed_train_samples += samples
        due = cadence.after_iteration(train)
        stop = cadence.stop(train.iteration, saved=due.save)
        if due != Due() or stop is not None:
            out[train.iteration] = (due.evaluate, due.save, due.collect_garbage,
                                    stop and stop.reason, stop and stop.save)  # fmt: skip
        if stop is not None:
            break
    return out


def test_cadence_decisions_per_iteration(tmp_path):
    save = str(tmp_path)
    # eval_interval 4, save_interval 3, train_iters 10: no evaluation after the last iteration.
    cadence, train = cadence_of(eval_interval=4, save=save, save_interval=3)
    assert decisions(cadence, train) == {
        3: (False, True, False, None, None),
        4: (True, False, False, None, None),
        6: (False, True, False, None, None),
        8: (True, False, False, None, None),
        9: (False, True, False, None, None),
    }
    assert train.iteration == 10
    # No validation data, no evaluation; no save directory, no save; manual_gc's interval.
    cadence, train = cadence_of(eval_interval=2, valid=False, save_interval=3, manual_gc=True,
                                manual_gc_interval=5)  # fmt: skip
    assert decisions(cadence, train) == {
        5: (False, False, True, None, None),
        10: (False, False, True, None, None),
    }
    # exit_interval: saves first unless that iteration saved already; or never, not saving.
    cadence, train = cadence_of(eval_interval=None, exit_interval=6, save=save, save_interval=3)
    assert decisions(cadence, train) == {
        3: (False, True, False, None, None),
        6: (False, True, False, "exit_interval=6", False),
    }
    cadence, train = cadence_of(eval_interval=None, exit_interval=4, save=save)
    assert decisions(cadence, train) == {4: (False, False, False, "exit_interval=4", True)}
    cadence, train = cadence_of(eval_interval=None, exit_interval=4)
    assert decisions(cadence, train) == {4: (False, False, False, "exit_interval=4", False)}
    # Megatron's order of reasons: SIGTERM, then exit_duration_in_mins (past 2.5 minutes at
    # iteration 7), then exit_interval and the end of a phase.
    cadence, train = cadence_of(eval_interval=None, exit_interval=7, signal_at={7},
                                exit_duration_in_mins=2.5, minutes=lambda it: it * 0.4)  # fmt: skip
    assert decisions(cadence, train) == {7: (False, False, False, "SIGTERM received", False)}
    cadence, train = cadence_of(eval_interval=None, exit_interval=7, exit_duration_in_mins=2.5,
                                phase_transition_iterations="7",
                                minutes=lambda it: it * 0.4)  # fmt: skip
    assert decisions(cadence, train) == {
        7: (False, False, False, "exit_duration_in_mins=2.5", False)
    }
    cadence, train = cadence_of(eval_interval=None, exit_interval=6, exit_duration_in_mins=2.5,
                                minutes=lambda it: it * 0.4)  # fmt: skip
    assert decisions(cadence, train) == {6: (False, False, False, "exit_interval=6", False)}
    cadence, train = cadence_of(eval_interval=None, exit_duration_in_mins=2.5,
                                minutes=lambda it: it * 0.4)  # fmt: skip
    assert decisions(cadence, train) == {
        7: (False, False, False, "exit_duration_in_mins=2.5", False)
    }
    # 0 sets no limit, as Megatron's `if args.exit_duration_in_mins`.
    cadence, train = cadence_of(eval_interval=None, exit_duration_in_mins=0,
                                minutes=lambda it: it * 0.4)  # fmt: skip
    assert decisions(cadence, train) == {} and not cadence.time_is_up()
    # train_samples: finished by samples, 4 a step.
    cadence, train = cadence_of(train_iters=None, train_samples=10, eval_interval=2)
    assert decisions(cadence, train, samples=4) == {2: (True, False, False, None, None)}
    assert (train.iteration, train.consumed_train_samples) == (3, 12)


def test_non_persistent_saves_come_between_the_saves(tmp_path):
    checkpoint = CheckpointConfig(save=str(tmp_path), save_interval=4,
                                  non_persistent_save_interval=3,
                                  non_persistent_ckpt_type="global")  # fmt: skip
    train = TrainState()
    cadence = Cadence(TrainingConfig(train_iters=12, exit_interval=9), checkpoint, False,
                      signal_received=lambda: False)  # fmt: skip
    due, stops = {}, {}
    while not cadence.finished(train):
        train.iteration += 1
        now = cadence.after_iteration(train)
        due[train.iteration] = (now.save, now.save_non_persistent)
        stop = cadence.stop(train.iteration, saved=now.save or now.save_non_persistent)
        if stop is not None:
            stops[train.iteration] = stop.save
            break
    saves = {i: d for i, d in due.items() if d != (False, False)}
    # 3, 6 and 9 non-persistent; 4 and 8 persistent. The exit at 9 counts 9 saved.
    assert saves == {3: (False, True), 4: (True, False), 6: (False, True), 8: (True, False),
                     9: (False, True)}  # fmt: skip
    assert stops == {9: False}
    # Not saving (no save), none at all.
    plain = Cadence(TrainingConfig(train_iters=12), CheckpointConfig(), False)
    assert not plain.after_iteration(TrainState(iteration=3)).save_non_persistent


def test_cadence_at_end(tmp_path):
    save = str(tmp_path)
    cadence, _ = cadence_of(eval_interval=4, save=save)
    assert cadence.at_end(10, None, last_saved=None) == Due(evaluate=True, save=True)
    assert cadence.at_end(10, None, last_saved=10) == Due(evaluate=True, save=False)
    # An early stop has saved already: neither.
    assert cadence.at_end(6, Stop("exit_interval=6", True), 6) == Due()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    assert cadence.at_end(10, None, last_saved=None) == Due(evaluate=True, save=False)
    # eval_interval None: no final evaluation; skip_train evaluates, never saves.
    cadence, _ = cadence_of(eval_interval=None, save=save)
    assert cadence.at_end(12, None, None) == Due(save=True)
    cadence, _ = cadence_of(eval_interval=5, skip_train=True, save=save)
    assert cadence.at_end(0, None, None) == Due(evaluate=True)
    cadence, _ = cadence_of(eval_interval=5, valid=False)
    assert cadence.at_end(10, None, None) == Due()


def test_the_test_split_is_evaluated_at_the_end_as_the_validation_is():
    cadence, _ = cadence_of(eval_interval=4, test=True)
    assert cadence.at_end(10, None, None) == Due(evaluate=True, test=True)
    assert cadence.at_end(6, Stop("exit_interval=6", True), 6) == Due()
    cadence, _ = cadence_of(eval_interval=4, valid=False, test=True)
    assert cadence.at_end(10, None, None) == Due(test=True)
    cadence, _ = cadence_of(eval_interval=None, test=True)
    assert cadence.at_end(10, None, None) == Due()
    cadence, _ = cadence_of(eval_interval=5, skip_train=True, test=True)
    assert cadence.at_end(0, None, None) == Due(evaluate=True, test=True)


def test_the_device_is_waited_for_every_train_sync_interval():
    cadence, train = cadence_of(eval_interval=None, train_sync_interval=4)
    waits = []
    while not cadence.finished(train):
        train.iteration += 1
        if cadence.after_iteration(train).synchronize:
            waits.append(train.iteration)
    assert waits == [4, 8]
    cadence, train = cadence_of(eval_interval=None)
    assert not cadence.after_iteration(TrainState(iteration=4)).synchronize


def test_each_phase_reads_its_own_samples_from_its_start():
    # Transitions at 3 and 7, 4 samples a step, 40 samples in all (10 iterations).
    assert phase_samples((3, 7), 4, 40, 0) == (12, 0)
    assert phase_samples((3, 7), 4, 40, 2) == (12, 8)
    assert phase_samples((3, 7), 4, 40, 3) == (16, 0)  # resumed at the transition
    assert phase_samples((3, 7), 4, 40, 5) == (16, 8)
    assert phase_samples((3, 7), 4, 40, 7) == (12, 0)
    assert phase_samples((3, 7), 4, 40, 10) == (12, 12)  # finished
    with pytest.raises(ValueError, match=r"sample 28, at or past the end of training \(20\)"):
        phase_samples((3, 7), 4, 20, 0)


def test_a_phase_ends_with_a_save_and_an_exit(tmp_path):
    cadence, train = cadence_of(eval_interval=None, save=str(tmp_path), save_interval=4,
                                phase_transition_iterations="6,4")  # fmt: skip
    assert decisions(cadence, train) == {
        4: (False, True, False, "iteration 4 ends a training phase "
                                "(phase_transition_iterations)", False),
    }  # fmt: skip
    cadence, train = cadence_of(eval_interval=None, save=str(tmp_path),
                                phase_transition_iterations="6,4")  # fmt: skip
    train.iteration = 4  # resumed at the end of the first phase: on to the second's end
    assert list(decisions(cadence, train)) == [6]
