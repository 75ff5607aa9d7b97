"""--qk-clip (MuonClip's QK-clip) through the real loop: the tiny model, clipped at a
threshold below its attention logits (0.24 at the start), trains with the one-rank loss
curve, gradient norms and logged max_attention_logit at TP2 (one query group per rank,
and one group shared by both ranks),
PP2, CP2 with the all-to-all, DP2 with the distributed optimizer, DP2 with ZeRO-3 and with
Muon (its layer-wise distributed optimizer): the clip reaches the model and the
optimizer's main parameters alike everywhere. At lr 0 the clip alone brings the logits
under the threshold within a few steps; --log-max-attention-logit logs without clipping."""

import pytest

from mp_gpt.testing import (
    assert_same_curve,
    metrics_records,
    tiny_curve,
    tiny_options,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

CLIP = ("--qk-clip", "--qk-clip-threshold", "0.1", "--qk-clip-alpha", "0.4")
LOGGED = ("lm loss", "grad_norm", "max_attention_logit")
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "cp2-a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
    "dp2-distopt": ["--use-distributed-optimizer"],
    "dp2-zero3": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return tiny_curve(tmp_path_factory.mktemp("one-rank"), 1, *CLIP)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qk_clip_trains_as_one_rank_in_every_layout(tmp_path, reference, name):
    assert_same_curve(tiny_curve(tmp_path, 2, *CLIP, *LAYOUTS[name]), reference, LOGGED, name)


def test_a_query_group_shared_by_two_ranks_clips_as_one_rank(tmp_path):
    """One query group at TP2: each rank holds half the group's query heads, so the group's
    largest logit is taken over both ranks before either scales its rows."""
    one_group = (*CLIP, "--num-query-groups", "1")
    one = tiny_curve(tmp_path / "one", 1, *one_group)
    shared = tiny_curve(tmp_path / "tp2", 2, *one_group, "--tensor-model-parallel-size", "2")
    assert_same_curve(shared, one, LOGGED, "tp2, one group")


def test_with_muon_the_layer_wise_optimizer_clips_as_one_rank(tmp_path):
    muon = ("--optimizer", "muon", "--muon-fp32-matmul-prec", "high")
    one = tiny_curve(tmp_path / "one", 1, *CLIP, *muon)
    layer_wise = tiny_curve(tmp_path / "two", 2, *CLIP, *muon, "--use-distributed-optimizer")
    assert_same_curve(layer_wise, one, LOGGED, "muon dp2")


def test_the_clip_alone_brings_the_logits_under_the_threshold(tmp_path, reference):
    still = ("--lr", "0", "--min-lr", "0", "--train-iters", "6")
    run_on_ranks(train_on_rank, 1, tiny_options(tmp_path / "clip", *CLIP, *still))
    clipped = [r["max_attention_logit"] for r in metrics_records(tmp_path / "clip")]
    run_on_ranks(train_on_rank, 1, tiny_options(tmp_path / "log", "--log-max-attention-logit",
                                                *still))  # fmt: skip
    logged = [r["max_attention_logit"] for r in metrics_records(tmp_path / "log")]
    assert clipped[0] == logged[0] == reference[0]["max_attention_logit"] > 0.2
    assert logged[-1] > 0.2  # without the clip nothing changes them (lr 0)
    assert clipped[-1] <= 0.1 * (1 + 1e-5)
