"""--use-mup through the real loop: the tiny model (hidden 128, tied embeddings) at a base
width of 32 trains with the one-rank loss curve and gradient norms at TP2 with sequence
parallelism, at PP2 (the last stage's copy of the tied embedding is embedding-class), at
DP2 with the distributed optimizer and at DP2 with ZeRO-3 (FSDP); the log shows --lr
while the hidden matrices follow lr / 4; and a resume at another base width is refused
by name."""

import pytest

from mp_gpt.testing import (
    assert_same_curve,
    metrics_records,
    tiny_curve,
    tiny_options,
    train_on_rank,
    train_output_on_rank,
    train_run_on_rank,
)
from mp_state.testing import RankFailure, run_on_ranks

pytestmark = pytest.mark.multirank

MUP = ("--use-mup", "--mup-base-hidden-size", "32", "--mup-embedding-mult", "2.0",
       "--mup-base-head-dim", "16", "--lr", "1e-3", "--min-lr", "1e-4")  # fmt: skip
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
    "dp2-zero3": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return tiny_curve(tmp_path_factory.mktemp("one-rank"), 1, *MUP)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mup_trains_as_one_rank_in_every_layout(tmp_path, reference, name):
    curve = tiny_curve(tmp_path, 2, *MUP, *LAYOUTS[name])
    assert_same_curve(curve, reference, ("lm loss", "grad_norm"), name)


def _groups_on_rank(argv):
    run = train_run_on_rank(argv)
    return [(bool(g.get("mup")), g["lr"], g.get("eps")) for g in run.optimizer.param_groups]


def test_the_hidden_matrices_follow_lr_over_the_width_multiplier(tmp_path, reference):
    argv = tiny_options(tmp_path, *MUP, "--lr-decay-style", "constant")
    (groups,) = run_on_ranks(_groups_on_rank, 1, argv, timeout=300)
    assert sorted(groups) == [(False, 1e-3, 1e-8), (False, 1e-3, 1e-8), (True, 2.5e-4, 2.5e-9)]
    assert {r["lr"] for r in metrics_records(tmp_path)} == {1e-3}  # the log's is --lr's
    plain = tmp_path / "plain"
    run_on_ranks(train_on_rank, 1, tiny_options(plain, "--lr", "1e-3", "--min-lr", "1e-4"))
    assert metrics_records(plain)[0]["lm loss"] != reference[0]["lm loss"]


def test_a_resume_at_another_base_width_is_refused(tmp_path):
    save = ("--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
            "--train-iters", "3")  # fmt: skip
    first = tiny_options(tmp_path / "a", *MUP, *save, "--exit-interval", "2")
    assert run_on_ranks(train_output_on_rank, 1, first)[0][0] == 0
    wider = tiny_options(tmp_path / "b", *MUP, *save, "--mup-base-hidden-size", "64")
    with pytest.raises(RankFailure, match=r"muP group has max_lr=0.00025, this run 0.0005"):
        run_on_ranks(train_output_on_rank, 1, wider)
    again = tiny_options(tmp_path / "c", *MUP, *save)
    assert run_on_ranks(train_output_on_rank, 1, again)[0][0] == 0
    assert [r["iteration"] for r in metrics_records(tmp_path / "c")] == [3]
