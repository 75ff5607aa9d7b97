"""--moe-use-upcycling through the real loop: tiny.yaml's dense model, trained two
iterations and saved, becomes a MoE model whose first loss is the dense model's on the
same batch (the dense checkpoint fine-tuned from iteration 0), with each MLP copied into
4 experts at EP2, and cut into 2 experts each of 8 at TP2 with sequence parallelism
(granular upcycling; squared ReLU, whose experts' scaling is exact at any granularity).
The converted model is saved at iteration 1, the first trained iteration is 2 (Megatron-
LM's), and a later run resumes from it without the flag. What cannot upcycle stops the
run with one line."""

from pathlib import Path

import pytest

from mp_ckpt import list_iterations
from mp_gpt.testing import metrics_records, tiny_options, train_on_rank
from mp_state.testing import RankFailure, run_on_ranks

pytestmark = pytest.mark.multirank

DENSE = ("--activation", "squared_relu")


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, float]:
    """The dense checkpoint, and its loss on the first batch of a run started from it."""
    root = tmp_path_factory.mktemp("dense")
    ckpt = root / "ckpt"
    trained = tiny_options(root / "run", *DENSE, "--train-iters", "2", "--save", str(ckpt))
    run_on_ranks(train_on_rank, 1, trained, timeout=300)
    start = tiny_options(root / "ft", *DENSE, "--train-iters", "2", "--load", str(ckpt),
                         "--finetune")  # fmt: skip
    run_on_ranks(train_on_rank, 1, start, timeout=300)
    return ckpt, metrics_records(root / "ft")[0]["lm loss"]


def moe(granularity: int) -> tuple[str, ...]:
    """4 experts per dense MLP, top-2 of them (top-2G of 4G at granularity G: the G
    slices of one MLP are chosen together)."""
    return (
        "--num-experts", str(4 * granularity), "--moe-router-topk", str(2 * granularity),
        "--moe-ffn-hidden-size", str(352 // granularity),
        "--moe-upcycling-granularity", str(granularity),
    )  # fmt: skip


LAYOUTS = {
    "copies-ep2": (1, ("--expert-model-parallel-size", "2")),
    "granular-tp2-sp": (2, ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_an_upcycled_model_computes_the_dense_models_loss(tmp_path, dense, name):
    ckpt, dense_loss = dense
    granularity, layout = LAYOUTS[name]
    save = tmp_path / "moe"
    flags = [*DENSE, *moe(granularity), *layout, "--load", str(ckpt), "--save", str(save)]
    upcycled = [*flags, "--train-iters", "4", "--exit-interval", "3", "--moe-use-upcycling"]
    run_on_ranks(train_on_rank, 2, tiny_options(tmp_path / "a", *upcycled), timeout=300)
    records = metrics_records(tmp_path / "a")
    assert [r["iteration"] for r in records] == [2, 3]
    assert abs(records[0]["lm loss"] - dense_loss) <= 1e-5 * dense_loss, (records, dense_loss)
    assert list_iterations(save)[:1] == [1]  # the converted model, before training
    if granularity == 1:  # later runs resume from it as from any checkpoint
        resumed = [*flags, "--load", str(save), "--train-iters", "4"]
        run_on_ranks(train_on_rank, 2, tiny_options(tmp_path / "b", *resumed), timeout=300)
        assert [r["iteration"] for r in metrics_records(tmp_path / "b")] == [4]


def test_what_cannot_upcycle_stops_the_run(tmp_path, dense):
    ckpt, _ = dense
    cases = {
        # the dense checkpoint's own folder holds a checkpoint already
        r"moe_use_upcycling: .*/ckpt already holds a checkpoint; upcycling is for the first "
        r"run only": [*moe(1), "--save", str(ckpt)],
        r"the dense decoder\.layers\.0\.mlp\.linear_fc1\.weight is 352 wide, not "
        r"moe_upcycling_granularity=2 x moe_ffn_hidden_size=88: give --moe-ffn-hidden-size "
        r"176": [*moe(2), "--moe-ffn-hidden-size", "88", "--save", str(tmp_path / "m")],
    }
    for message, flags in cases.items():
        argv = tiny_options(tmp_path / "run", *DENSE, "--load", str(ckpt), *flags,
                            "--moe-use-upcycling")  # fmt: skip
        with pytest.raises(RankFailure, match=message):
            run_on_ranks(train_on_rank, 1, argv, timeout=300)
