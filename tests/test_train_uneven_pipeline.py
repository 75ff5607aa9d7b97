"""--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the tiny
model's 4 layers split 1 + 3 and 3 + 1 over two pipeline stages train to the one-stage
loss curve, and the checkpoint of an uneven run loads at an even layout."""

import pytest

from mp_gpt.testing import assert_same_curve, metrics_records, tiny_options, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

LOGGED = ("lm loss", "grad_norm")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pp1")
    run_on_ranks(train_on_rank, 1, tiny_options(run_dir), timeout=300)
    return metrics_records(run_dir)


@pytest.mark.parametrize("first,last", [(1, None), (None, 1)])
def test_an_uneven_split_trains_like_one_stage(tmp_path, reference, first, last):
    flags = ["--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "ckpt"),
             "--save-interval", "4"]  # fmt: skip
    if first is not None:
        flags += ["--decoder-first-pipeline-num-layers", str(first)]
    if last is not None:
        flags += ["--decoder-last-pipeline-num-layers", str(last)]
    run_on_ranks(train_on_rank, 2, tiny_options(tmp_path, *flags), timeout=300)
    assert_same_curve(metrics_records(tmp_path), reference, LOGGED, f"PP2 {first}/{last}")
    # the checkpoint numbers layers model-wide: an even PP2 run resumes from it
    resumed = tmp_path / "resumed"
    flags = ["--pipeline-model-parallel-size", "2", "--train-iters", "5",
             "--use-checkpoint-opt-param-scheduler", "--load", str(tmp_path / "ckpt")]  # fmt: skip
    argv = tiny_options(resumed, *flags)
    run_on_ranks(train_on_rank, 2, argv, timeout=300)
    assert [r["iteration"] for r in metrics_records(resumed)] == [5]


def test_the_split_must_fit():
    from mp_pipeline import stage_layers
    from mp_state import ParallelConfig

    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size > 1"):
        ParallelConfig(decoder_first_pipeline_num_layers=1)
    with pytest.raises(ValueError):
        stage_layers(4, 2, 0, num_layers_in_first_pipeline_stage=5)
