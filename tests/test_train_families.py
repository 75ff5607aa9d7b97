"""Today's MoE families (Qwen3-MoE, gpt-oss, Llama 4, a Mamba hybrid with a multi-token
prediction module) train with the one-rank loss curve at TP2 (with sequence parallelism),
EP2, PP2, the hybrid at CP2 (all-to-all) and gpt-oss at CP2 (the ring), through
apps/gpt's pretrain (fp32, dropout 0), and the hybrid split by its pattern's pipeline
segments ("|") at PP2 and at PP2 x VPP2; a hybrid with gated DeltaNet (G) layers at TP2
and CP2: apps/gpt's tiny-moe config with each family's Megatron flags put over it."""

import pytest

from mp_gpt.testing import (
    assert_same_curve,
    metrics_records,
    tiny_moe_options,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

LOGGED = ("lm loss", "load_balancing_loss", "grad_norm")
ALSO_LOGGED = {"hybrid": ("mtp_1 loss",), "hybrid_gdn": ("mtp_1 loss",)}

FAMILIES = {
    # Qwen3-MoE: qk-layernorm, a head dim (64) other than hidden / heads (32), the top-k
    # probabilities renormalized, no shared expert, untied output layer
    "qwen3_moe": ["--qk-layernorm", "--kv-channels", "64", "--num-moe-experts", "8",
                  "--moe-router-topk", "4", "--moe-z-loss-coeff", "0",
                  "--untie-embeddings-and-output-weights"],
    # gpt-oss: sinks, a window of 16 on odd-numbered layers, YaRN, biases on every linear
    # layer and the router, clamped quick GEGLU experts, softmax after the top k
    "gpt_oss": ["--softmax-type", "learnable", "--window-size", "15,0",
                "--window-attn-skip-freq", "2", "--position-embedding-type", "yarn",
                "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "16",
                "--activation", "gelu", "--quick-geglu", "--glu-linear-offset", "1.0",
                "--activation-func-clamp-value", "7.0", "--add-bias-linear", "--add-qkv-bias",
                "--moe-z-loss-coeff", "0", "--untie-embeddings-and-output-weights"],
    # Llama 4 (Maverick's layout): interleaved rotary pairs with Llama 3.1's scaling, no
    # rotary embeddings on every second layer (their queries scaled from position 7 on),
    # L2-normalized queries and keys on the others, which attend within blocks of 16
    # positions; dense and MoE layers alternating, top-1 sigmoid routing applied to the
    # experts' input beside a shared expert
    "llama4": ["--rotary-interleaved", "--use-rope-scaling", "--rope-scaling-factor", "8",
               "--no-rope-freq", "2", "--qk-l2-norm", "--qk-l2-norm-layers", "rope",
               "--attention-chunk-size", "16", "--attn-temperature-floor-scale", "8",
               "--moe-layer-freq", "([0,1]*2)", "--moe-router-topk", "1",
               "--moe-router-score-function", "sigmoid", "--moe-apply-probs-on-input",
               "--moe-shared-expert-intermediate-size", "128", "--moe-z-loss-coeff", "0",
               "--untie-embeddings-and-output-weights"],
    # A Mamba-hybrid model (Nemotron 3's kinds of layers): a Mamba-2 mixer, attention,
    # another mixer and a MoE MLP, one per layer; squared-ReLU experts with sigmoid routing,
    # running at a latent width of 48 (Nemotron 3 Super's latent MoE); weights drawn with
    # std 0.1, so that the four projections in a row of the latent experts carry gradients
    # that count (at 0.02 a missing reduction of their gradient over TP went unseen); one
    # multi-token prediction module of a mixer, attention and experts (Megatron's unified
    # pattern: the layers after "/")
    "hybrid": ["--hybrid-layer-pattern", "M*ME/M*E", "--mamba-num-heads", "8",
               "--mamba-head-dim", "16", "--mamba-num-groups", "2", "--mamba-state-dim", "16",
               "--squared-relu", "--moe-router-score-function", "sigmoid",
               "--moe-latent-size", "48", "--init-method-std", "0.1", "--moe-z-loss-coeff",
               "0", "--untie-embeddings-and-output-weights"],
    # The hybrid with gated DeltaNet (G) layers in place of its second mixer and in its
    # module (Megatron's HybridModel), SwiGLU experts (the DeltaNet's activation)
    "hybrid_gdn": ["--hybrid-layer-pattern", "M*GE/G*E", "--mamba-num-heads", "8",
                   "--mamba-head-dim", "16", "--mamba-num-groups", "2",
                   "--mamba-state-dim", "16", "--linear-num-key-heads", "2",
                   "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
                   "--linear-value-head-dim", "16", "--swiglu",
                   "--moe-router-score-function", "sigmoid", "--init-method-std", "0.1",
                   "--moe-z-loss-coeff", "0", "--untie-embeddings-and-output-weights"],
}  # fmt: skip
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep2": ["--expert-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    # all-to-all context parallelism
    "cp2": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
    # the ring: gpt-oss's window of 16 over chunks of 16 positions masks the blocks of
    # neighbouring chunks in part and skips the others
    "cp2-p2p": ["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
    # Megatron's "|" pipeline segments of a hybrid pattern: three layers then one, and one
    # segment per virtual stage (interleaved, two chunks per rank)
    "pp2-segments": ["--pipeline-model-parallel-size", "2",
                     "--hybrid-layer-pattern", "M*M|E/M*E"],
    "pp2-vpp2-segments": ["--pipeline-model-parallel-size", "2",
                          "--hybrid-layer-pattern", "M|*|M|E/M*E"],
}  # fmt: skip
HYBRID_ONLY = {"cp2", "pp2-segments", "pp2-vpp2-segments"}
# Every family at every layout, except CP2 and the segments: the hybrid's alone (the
# attention of the others across CP ranks is trained in test_train_context_parallel.py and
# mp-layers' test_context_parallel_attention.py; Llama 4's chunks shorter than the
# sequence are refused there, packages/mp-train/tests/test_validate.py).
RUNS = [(family, layout) for family in sorted(FAMILIES) for layout in sorted(LAYOUTS)
        if (layout not in HYBRID_ONLY or family == "hybrid")
        and family != "hybrid_gdn" and layout != "cp2-p2p"]  # fmt: skip
# the gated DeltaNet hybrid where its heads are split: TP2 and CP2 (all-to-all); gpt-oss's
# sinks and windows over the ring
RUNS += [("hybrid_gdn", "tp2"), ("hybrid_gdn", "cp2"), ("gpt_oss", "cp2-p2p")]


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(request.param)
    options = tiny_moe_options(run_dir, *FAMILIES[request.param])
    run_on_ranks(train_on_rank, 1, options, timeout=300)
    return request.param, metrics_records(run_dir)


@pytest.mark.parametrize(("reference", "layout"), RUNS, indirect=["reference"])
def test_family_trains_as_one_rank(tmp_path, reference, layout):
    family, want = reference
    options = tiny_moe_options(tmp_path, *FAMILIES[family], *LAYOUTS[layout])
    run_on_ranks(train_on_rank, 2, options, timeout=300)
    assert len(want) == 4
    logged = LOGGED + ALSO_LOGGED.get(family, ())
    assert_same_curve(metrics_records(tmp_path), want, logged, f"{family} {layout}")
