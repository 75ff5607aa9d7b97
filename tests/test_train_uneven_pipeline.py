"""--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the tiny
model's 4 layers split 1 + 3 and 3 + 1 over two pipeline stages, and 2 + 1 + 1 over
three, train to the one-stage loss curve (a split that does not fit is named before any
rank starts), and the checkpoint of an uneven run loads at an even layout. Megatron-LM's
--pipeline-model-parallel-layout places them as written (3 + 1; four virtual stages on
two ranks, with and without the embedding and the loss alone on a stage) with the same
curve; DeepSeek-V3's last stage of the multi-token prediction module and the loss alone
trains as one rank does and its checkpoint loads at an even split. With
--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split the
embedding and the loss count as a layer each (1 + 2 + 1 on three stages; six virtual
stages on two ranks, the first and the last without a decoder layer) with the same
curve. Flags that also split the layers are refused before any rank starts."""

import pytest

from mp_gpt.testing import (
    assert_same_curve,
    metrics_records,
    tiny_options,
    train_on_rank,
    train_run_on_rank,
)
from mp_state.testing import run_on_ranks
from mp_train import parse_config, validate

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


def test_three_stages_of_2_1_1_layers_train_like_one_stage(tmp_path, reference):
    """4 layers on 3 stages: a split Megatron-LM takes (the first stage's 2, then 1 on each
    of the others), though 4 is not divisible by 3."""
    flags = ["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "2"]
    got = run_on_ranks(layers_on_rank, 3, tiny_options(tmp_path, *flags), timeout=300)
    assert got == [[[0, 1]], [[2]], [[3]]]
    assert_same_curve(metrics_records(tmp_path), reference, LOGGED, "PP3 2/None")


@pytest.mark.parametrize("flags,message", [
    (["--decoder-first-pipeline-num-layers", "3"], "the other 2 stages would share 1 layers"),
    (["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "3"],
     "the other 1 stages would share -1 layers"),
    (["--decoder-first-pipeline-num-layers", "2", "--virtual-pipeline-model-parallel-size", "2"],
     "stage 1 holds 1 layers, not divisible by virtual"),
])  # fmt: skip
def test_an_uneven_split_that_does_not_fit_is_named(tmp_path, monkeypatch, flags, message):
    monkeypatch.setenv("MP_RUN_DIR", str(tmp_path))
    config = parse_config(tiny_options(tmp_path, "--pipeline-model-parallel-size", "3", *flags))
    with pytest.raises(ValueError, match=f"^decoder_first_pipeline_num_layers=.*{message}"):
        validate(config, 3)


def test_the_split_must_fit():
    from mp_pipeline import stage_layers
    from mp_state import ParallelConfig

    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size > 1"):
        ParallelConfig(decoder_first_pipeline_num_layers=1)
    with pytest.raises(ValueError):
        stage_layers(4, 2, 0, num_layers_in_first_pipeline_stage=5)


def layers_on_rank(argv: list[str]) -> list[list[int]]:
    """The decoder layers (model-wide indices) of each of this rank's chunks, after the run."""
    run = train_run_on_rank(argv)
    return [[layer.layer_number for layer in chunk.module.decoder.layers] for chunk in run.model]


@pytest.mark.parametrize("layout,held", [
    ("Ettt|tL", [[[0, 1, 2]], [[3]]]),
    ("Et|t|t|tL", [[[0], [2]], [[1], [3]]]),  # chunk c of rank r: virtual stage c * 2 + r
    ("E|tt|tt|L", [[[], [2, 3]], [[0, 1], []]]),  # the embedding, the loss alone
])  # fmt: skip
def test_a_megatron_layout_places_the_layers(tmp_path, reference, layout, held):
    flags = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", layout]
    got = run_on_ranks(layers_on_rank, 2, tiny_options(tmp_path, *flags), timeout=300)
    assert got == held
    assert_same_curve(metrics_records(tmp_path), reference, LOGGED, layout)


def test_a_last_stage_of_mtp_and_loss_alone(tmp_path):
    mtp = ["--mtp-num-layers", "1"]
    run_on_ranks(train_on_rank, 1, tiny_options(tmp_path / "one", *mtp), timeout=300)
    flags = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
             "Etttt|mL", "--save", str(tmp_path / "ckpt"), "--save-interval", "4"]  # fmt: skip
    got = run_on_ranks(layers_on_rank, 2, tiny_options(tmp_path / "pp2", *mtp, *flags),
                       timeout=300)  # fmt: skip
    assert got == [[[0, 1, 2, 3]], [[]]]
    want = metrics_records(tmp_path / "one")
    assert_same_curve(metrics_records(tmp_path / "pp2"), want, LOGGED, "Etttt|mL")
    resumed = tmp_path / "resumed"  # at an even split, from the checkpoint of iteration 4
    flags = ["--pipeline-model-parallel-size", "2", "--train-iters", "5",
             "--use-checkpoint-opt-param-scheduler", "--load", str(tmp_path / "ckpt")]  # fmt: skip
    run_on_ranks(train_on_rank, 2, tiny_options(resumed, *mtp, *flags), timeout=300)
    assert [r["iteration"] for r in metrics_records(resumed)] == [5]


def test_a_layout_refuses_the_flags_that_also_split_the_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("MP_RUN_DIR", str(tmp_path))
    layout = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
              "Et|t|t|tL"]  # fmt: skip
    config = parse_config(tiny_options(tmp_path, *layout))
    assert config.parallel.virtual_pipeline_model_parallel_size == 2
    for extra, message in (
        (["--decoder-first-pipeline-num-layers", "1"], "drop --decoder-first-pipeline"),
        (["--virtual-pipeline-model-parallel-size", "4"], "not --virtual-pipeline-model"),
        (["--hybrid-layer-pattern", "*-*-"], "beside --hybrid-layer-pattern"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_config(tiny_options(tmp_path, *layout, *extra))


ACCOUNTED = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]


@pytest.mark.parametrize("ranks,layout,held", [
    (3, [], [[[0]], [[1, 2]], [[3]]]),
    (2, ["--virtual-pipeline-model-parallel-size", "3"], [[[], [1], [3]], [[0], [2], []]]),
])  # fmt: skip
def test_the_embedding_and_the_loss_counted_as_layers(tmp_path, reference, ranks, layout, held):
    flags = ["--pipeline-model-parallel-size", str(ranks), *layout, *ACCOUNTED]
    got = run_on_ranks(layers_on_rank, ranks, tiny_options(tmp_path, *flags), timeout=300)
    assert got == held
    assert_same_curve(metrics_records(tmp_path), reference, LOGGED, f"counted, PP{ranks}")


def test_counting_the_embedding_refuses_the_other_splits(tmp_path, monkeypatch):
    monkeypatch.setenv("MP_RUN_DIR", str(tmp_path))
    pp2 = ["--pipeline-model-parallel-size", "2", *ACCOUNTED]
    for extra, message in (
        (["--decoder-last-pipeline-num-layers", "1"], "both place the layers on the stages"),
        (["--pipeline-model-parallel-layout", "Ett|ttL"], "both place the layers"),
        (["--hybrid-layer-pattern", "*-*-"], "placed by the pattern's '|'"),
        (["--virtual-pipeline-model-parallel-size", "2"], "3 per pipeline stage, are not "
                                                          "divisible by virtual"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            config = parse_config(tiny_options(tmp_path, *pp2, *extra))
            validate(config, 2)
