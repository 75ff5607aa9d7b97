"""Megatron's --exit-signal-handler-for-training: SIGINT or SIGTERM ends the rank at once,
with one line and exit status 0, without a save."""

import os
import signal

import pytest

from mp_gpt.testing import complete_records, tiny_options
from mp_state.testing import run_on_ranks
from mp_train import TrainingShutdown
from mp_train.loop.signals import shutdown_on_signals

pytestmark = pytest.mark.multirank


def signalled_at_iteration_3(argv, name):
    """main(argv) with the signal sent to this rank during its third iteration's forward;
    (main's status, what it wrote to stderr)."""
    import contextlib
    import io

    import torch

    import mp_gpt.pretrain

    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")  # tiny.yaml's data paths, unread
    real, calls = mp_gpt.pretrain.forward_step, []

    def forward_step(data_iterator, model, **kwargs):
        calls.append(1)
        if len(calls) == 3 * 4:  # the last micro-batch of iteration 3 (4 per iteration)
            os.kill(os.getpid(), signal.Signals[name])
        return real(data_iterator, model, **kwargs)

    mp_gpt.pretrain.forward_step = forward_step
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = mp_gpt.pretrain.main(argv)
    return status, err.getvalue()


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_run_at_once_with_status_0(tmp_path, name):
    save = tmp_path / "ckpt"
    argv = tiny_options(
        tmp_path,
        "--train-iters",
        "20",
        "--save",
        str(save),
        "--save-interval",
        "100",
        "--exit-signal-handler-for-training",
    )
    status, err = run_on_ranks(signalled_at_iteration_3, 1, argv, name, timeout=120)[0]
    assert status == 0, err
    assert f"rank 0: {name} received: the run ends here without a save" in err
    assert "Traceback" not in err
    assert len(complete_records(tmp_path)) == 2  # iteration 3 did not finish
    assert not save.exists() or not any(save.glob("iter_*"))


def test_the_handlers_are_the_runs_alone():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingShutdown) as stopped, shutdown_on_signals(True):
        os.kill(os.getpid(), signal.SIGTERM)
    assert (stopped.value.code, stopped.value.reason) == (0, "SIGTERM received")
    assert signal.getsignal(signal.SIGTERM) is before
    with shutdown_on_signals(False):
        assert signal.getsignal(signal.SIGTERM) is before
