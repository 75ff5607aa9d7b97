"""mp_gpt.testing does in the test process the start-up work that every rank forked from
it would repeat: a tiny run's rank builds no mock dataset and reads no config class's
source again, also after the test process's own datasets have pushed the runs' out of
mp-data's memory."""

import ast
from types import SimpleNamespace

import numpy as np
import pytest

from mp_data import INDICES_KEPT, GPTDatasetConfig, MockGPTDataset, Split, kept_indices
from mp_gpt.testing import tiny_moe_options, tiny_options, train_on_rank
from mp_state.testing import run_on_ranks


def fresh_work_on_rank(argv: list[str]) -> tuple[list[str], list[str], int]:
    """(the mock datasets kept before the run, those built during it, the Python sources
    the run parsed: the parser reads its help texts from the config classes' source)."""
    parsed = []
    parse = ast.parse
    ast.parse = lambda source, *args, **kwargs: parsed.append(1) or parse(source, *args, **kwargs)
    before = kept_indices()
    train_on_rank(argv)
    return before, [key for key in kept_indices() if key not in before], len(parsed)


@pytest.mark.parametrize("options", [tiny_options, tiny_moe_options])
def test_a_tiny_runs_rank_finds_its_start_up_work_done(tmp_path, options):
    argv = options(tmp_path)
    [(before, built, parsed)] = run_on_ranks(fresh_work_on_rank, 1, argv, timeout=120)
    assert len(before) >= 3  # train, valid and test at least
    assert built == [] and parsed == 0


def test_the_datasets_are_built_again_once_pushed_out(tmp_path):
    tokenizer = SimpleNamespace(vocab_size=100, eod=0, pad=1)
    for seed in range(INDICES_KEPT):  # as many other datasets built in this process
        config = GPTDatasetConfig(random_seed=100 + seed, sequence_length=64, mock=True,
                                  tokenizer=tokenizer, split="1")  # fmt: skip
        MockGPTDataset(None, None, np.arange(100, dtype=np.int32), 10, Split.train, config)
    argv = tiny_options(tmp_path)
    [(_, built, _)] = run_on_ranks(fresh_work_on_rank, 1, argv, timeout=120)
    assert built == []
