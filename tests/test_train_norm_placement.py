"""OLMo 2's norms (each sublayer's output normalized, queries and keys over all heads)
train through apps/gpt's pretrain with the one-rank loss curve and gradient norm at PP2;
OLMo 3's layers (OLMo 2's with a window on every other layer, rotated by plain RoPE of
their own base while the others take YaRN) and Gemma 3's (sandwich norms of 1 + w,
gated tanh-GELU, scaled embeddings and scores, windows with their own RoPE base beside
linearly scaled full layers) at TP2 with sequence parallelism (the output norms'
gradients summed over the ranks, the all-heads norms' sums of squares added up) and at
CP2; Ministral 3's rotated queries scaled by their position (query_log_scale_beta, steps of
16 positions) with YaRN at CP2, each rank scaling its load-balanced chunks by their true
positions: the tiny config, fp32, 4 iterations."""

import pytest

from mp_gpt.testing import (
    GIVEN_PEAK,
    TINY_CONFIG,
    assert_same_curve,
    metrics_records,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

PLACEMENTS = {
    "olmo2": ["--sublayer-norm", "output", "--qk-layernorm", "--qk-layernorm-scope",
              "all_heads"],
    "gemma3": ["--sublayer-norm", "both", "--qk-layernorm", "--apply-layernorm-1p",
               "--activation", "geglu", "--openai-gelu", "--scale-word-embeddings",
               "--query-pre-attn-scalar", "24", "--window-size", "15,0",
               "--window-attn-skip-freq", "2", "--window-rotary-base", "10000",
               "--rotary-base", "1000000", "--rotary-seq-len-interpolation-factor", "8"],
    "olmo3": ["--sublayer-norm", "output", "--qk-layernorm", "--qk-layernorm-scope",
              "all_heads", "--window-size", "15,0", "--window-attn-skip-freq", "2",
              "--window-rotary-base", "10000", "--rotary-base", "500000",
              "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
              "--yarn-original-max-position-embeddings", "16"],
    "ministral3": ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
                   "--yarn-original-max-position-embeddings", "16", "--query-log-scale-beta",
                   "0.5", "--query-log-scale-length", "16"],
}  # fmt: skip
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
}


def options(run_dir, *extra: str) -> list[str]:
    return [
        "--config", str(TINY_CONFIG), "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--make-vocab-size-divisible-by", "512", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
        "--eval-interval", "none", "--log-interval", "10", "--save", "none", "--load", "none",
        "--tensorboard-dir", "none", "--metrics-file", str(run_dir / "metrics.jsonl"),
        "--num-workers", "0", "--lr-warmup-iters", "1", "--init-method-std", "0.1", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(request.param)
    run_on_ranks(train_on_rank, 1, options(run_dir, *PLACEMENTS[request.param]), timeout=300)
    return request.param, metrics_records(run_dir)


RUNS = [("olmo2", "pp2"), ("olmo3", "tp2-sp"), ("olmo3", "cp2"), ("gemma3", "tp2-sp"),
        ("gemma3", "cp2"), ("ministral3", "cp2")]  # fmt: skip


@pytest.mark.parametrize(("reference", "layout"), RUNS, indirect=["reference"])
def test_norm_placement_trains_as_one_rank(tmp_path, reference, layout):
    placement, want = reference
    run_on_ranks(train_on_rank, 2, options(tmp_path, *PLACEMENTS[placement], *LAYOUTS[layout]),
                 timeout=300)  # fmt: skip
    assert len(want) == 4
    assert_same_curve(metrics_records(tmp_path), want, ("lm loss", "grad_norm"),
                      f"{placement} {layout}")  # fmt: skip
