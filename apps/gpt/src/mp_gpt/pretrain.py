"""`pretrain_gpt.py`: GPT pretraining from a YAML file and/or Megatron-style options.

torchrun --nproc-per-node 2 apps/gpt/pretrain_gpt.py --config apps/gpt/configs/tiny.yaml
"""

from __future__ import annotations

import sys

from mp_gpt import program

if __name__ == "__main__":
    program.imports_begin()  # started as a program: mp_gpt.program says why

import functools

import torch.distributed as dist

import mp_state
from mp_ckpt import failure_line
from mp_gpt.gpt import datasets_provider, forward_step, model_provider
from mp_train import (
    ConfigError,
    RunConfig,
    TrainingShutdown,
    launch_rank,
    load_config,
    pretrain,
    report,
)

__all__ = ["main", "train"]


def train(config: RunConfig):
    """Pretrains a GPT with `config` (collective: every rank calls it); returns the run."""
    step = functools.partial(forward_step, documents=config.data.batches_carry_documents)
    return pretrain(config, model_provider=model_provider, datasets_provider=datasets_provider,
                    forward_step_func=step)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Runs `pretrain_gpt.py ARGV`; returns the exit status: 0, 2 for a configuration
    mistake (one line from rank 0, the same mistake found by every rank), or the rerun
    engine's 16 (resume on other hardware) or 17 (a loss or gradient failed result
    validation). Any other error
    is printed as `error: rank N: MESSAGE` and raised, so that the rank exits non-zero at
    once with its traceback."""
    try:
        run = train(load_config(argv))
    except ConfigError as error:
        # Every rank found the same mistake: the collective teardown below meets them all.
        status = report(error)
    except TrainingShutdown as stop:  # exit_signal_handler_for_training
        print(f"rank {launch_rank()}: {stop.reason}: the run ends here without a save "
              "(exit_signal_handler_for_training)", file=sys.stderr, flush=True)  # fmt: skip
        return 0  # no teardown: the other ranks may be in a collective this one left
    except BaseException as error:  # torch's CheckpointException is a BaseException
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        # This rank may have failed alone (one of its data-loader workers died, a step
        # raised): its peers may sit in a collective it will never join, where a teardown
        # barrier would hold it with them until the collective timeout (10 minutes). It
        # leaves now; torchrun ends the other ranks once one has exited non-zero.
        rank = launch_rank()
        print(f"error: rank {rank}: {failure_line(error, rank)}", file=sys.stderr, flush=True)
        raise
    else:
        status = run.exit_code  # 0, or the rerun engine's 16 or 17
    mp_state.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(program.run(main))
