"""A torchrun job that a test starts, watches, injects faults into and ends.

    with TorchrunJob(["-m", "mp_gpt.pretrain", *options], run_dir) as job:
        job.wait_for(lambda: read_tracker(ckpt) is not None, "a first checkpoint")
        os.kill(job.workers()[1], signal.SIGKILL)
        took = job.wait(timeout=60)       # seconds until the whole job ended
    assert job.returncode != 0 and "..." in job.output()

Everything the job prints goes to run_dir/output.log (a file, not a pipe: a pipe
nobody reads fills up and blocks the job). Leaving the `with` block kills whatever is
left of the job: torchrun starts each worker in a session of its own, so its workers,
their children (data-loader workers) and stopped processes are killed one by one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mp_state.devices import DEVICE_ENV
from mp_state.testing.processes import alive, children, workers_of

__all__ = ["TorchrunJob"]


class TorchrunJob:
    """`python -m torch.distributed.run --standalone --nproc-per-node N --log-dir
    run_dir/torchrun-logs [launcher_args] TARGET...` with OMP_NUM_THREADS=1,
    MP_RUN_DIR=run_dir and MP_DEVICE=device (cpu by default: gloo, even on a machine with
    GPUs; cuda: one GPU per worker, NCCL), output in run_dir/output.log."""

    def __init__(self, target: list[str], run_dir: Path, *, nproc: int = 2,
                 launcher_args: tuple[str, ...] = (), env: dict | None = None,
                 device: str = "cpu") -> None:  # fmt: skip
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: expected cpu or cuda")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = run_dir / "output.log"
        # torchrun's log folder in run_dir: by default it makes one under /tmp and
        # leaves it there.
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "--log-dir", str(run_dir / "torchrun-logs"),
                   *launcher_args, *target]  # fmt: skip
        environment = {**os.environ, "MP_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1",
                       DEVICE_ENV: device, **(env or {})}  # fmt: skip
        with self.log.open("a") as log:
            self.process = subprocess.Popen(command, env=environment, start_new_session=True,
                                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        self._seen_workers: set[int] = set()

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> dict[int, int]:
        """The running workers' pids by rank."""
        found = workers_of(self.process.pid)
        self._seen_workers.update(found.values())
        return found

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 180,
                 poll: float = 0.05) -> float:  # fmt: skip
        """Polls until `condition()` holds; returns the seconds it took. Fails, with the
        end of the output, if the job exits first or `timeout` passes."""
        start = time.monotonic()
        while not condition():
            if self.process.poll() is not None:
                raise AssertionError(f"the job exited ({self.process.returncode}) before "
                                     f"{what}:\n{self.output()[-4000:]}")  # fmt: skip
            if time.monotonic() - start > timeout:
                raise AssertionError(f"{what}: not within {timeout:.0f} s\n"
                                     f"{self.output()[-4000:]}")  # fmt: skip
            time.sleep(poll)
        return time.monotonic() - start

    def wait(self, timeout: float) -> float:
        """Waits for the launcher to exit; returns the seconds it took. A job still
        running after `timeout` is killed and reported as hung, with its output."""
        start = time.monotonic()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job hung: still running {timeout:.0f} s later\n"
                                 f"{self.output()[-4000:]}") from None  # fmt: skip
        return time.monotonic() - start

    def kill(self) -> None:
        """SIGKILL to every process of the job (stopped ones are continued so that they
        die at once), the launcher last; returns once the workers are gone."""
        workers = set(self.workers().values()) | self._seen_workers
        doomed = [pid for worker in workers for pid in children(worker)] + sorted(workers)
        for pid in doomed:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in doomed):  # SIGKILL is delivered asynchronously
            if time.monotonic() > deadline:
                raise AssertionError(f"processes {doomed} outlived SIGKILL")
            time.sleep(0.02)

    def __enter__(self) -> TorchrunJob:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None or any(alive(pid) for pid in self._seen_workers):
            self.kill()
