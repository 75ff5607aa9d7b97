"""Megatron's --decoupled-lr / --decoupled-min-lr through the real loop: the word
embedding and the output layer follow their own learning rate, every other weight
follows --lr, and a resume settles a changed decoupled rate as the scheduler settles
its own (refused unless --override-opt-param-scheduler or
--use-checkpoint-opt-param-scheduler says which one wins)."""

import pytest
import torch

from mp_gpt.testing import metrics_records, tiny_options, train_output_on_rank, train_run_on_rank
from mp_state.testing import RankFailure, run_on_ranks

pytestmark = pytest.mark.multirank

# --lr 0: only a decoupled learning rate moves anything (weight decay is scaled by lr too).
STILL = ("--lr", "0", "--min-lr", "0", "--train-iters", "3",
         "--untie-embeddings-and-output-weights")  # fmt: skip


def _weights_on_rank(argv: list[str]) -> dict[str, torch.Tensor]:
    run = train_run_on_rank(argv)
    return {name: p.detach().clone() for name, p in run.model[0].module.named_parameters()}


def test_only_the_embedding_and_output_layer_follow_a_decoupled_lr(tmp_path):
    plain, decoupled = tmp_path / "plain", tmp_path / "decoupled"
    (before,) = run_on_ranks(_weights_on_rank, 1, tiny_options(plain, *STILL))
    (after,) = run_on_ranks(
        _weights_on_rank, 1,
        tiny_options(decoupled, *STILL, "--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-3"),
    )  # fmt: skip
    moved = sorted(name for name in before if not torch.equal(before[name], after[name]))
    assert moved == ["embedding.weight", "output_layer.weight"], moved
    # The log's learning rate is --lr's (Megatron logs its default-schedule group's).
    assert [r["lr"] for r in metrics_records(decoupled)] == [0.0, 0.0, 0.0]


def test_a_resume_with_another_decoupled_lr_needs_a_say_on_which_one_wins(tmp_path):
    save = ("--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"))
    first = tiny_options(tmp_path / "a", *save, "--decoupled-lr", "1e-2", "--train-iters", "2")
    assert run_on_ranks(train_output_on_rank, 1, first)[0][0] == 0
    changed = tiny_options(tmp_path / "b", *save, "--decoupled-lr", "2e-2", "--train-iters", "3")
    with pytest.raises(RankFailure, match=r"max_lr=0.01, this run 0.02 \(decoupled_lr\): pass "
                       "--override-opt-param-scheduler"):  # fmt: skip
        run_on_ranks(train_output_on_rank, 1, changed)
    overridden = [*changed, "--override-opt-param-scheduler"]
    assert run_on_ranks(train_output_on_rank, 1, overridden)[0][0] == 0
    assert [r["iteration"] for r in metrics_records(tmp_path / "b")] == [3]
