"""`pretrain_gpt.py`: GPT pretraining from a YAML file and/or Megatron-style options.

torchrun --nproc-per-node 2 apps/gpt/pretrain_gpt.py --config apps/gpt/configs/tiny.yaml
"""

from __future__ import annotations

import functools
import sys

import torch.distributed as dist

import mp_state
from mp_gpt.gpt import datasets_provider, forward_step, model_provider
from mp_train import ConfigError, RunConfig, load_config, pretrain, report

__all__ = ["main", "train"]


def train(config: RunConfig):
    """Pretrains a GPT with `config` (collective: every rank calls it); returns the run."""
    step = functools.partial(forward_step, attention_mask=config.data.batches_carry_attention_mask)
    return pretrain(config, model_provider=model_provider, datasets_provider=datasets_provider,
                    forward_step_func=step)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Runs `pretrain_gpt.py ARGV`; returns the exit status: 0, or 2 for a configuration
    mistake (one line from rank 0, the same mistake found by every rank)."""
    try:
        train(load_config(argv))
    except ConfigError as error:
        return report(error)
    finally:
        mp_state.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
