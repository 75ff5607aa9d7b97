"""The fixture cases generate.py writes: each model's Megatron-LM flags, its format and
layout (tp, pp, dp, ep, the distributed optimizer) and the common run settings
(sequence, micro-batch, vocabulary, iterations, seed). README.md describes each case."""

from typing import NamedTuple

SEQ = 16
MICRO_BATCH = 2
VOCAB = 100  # tokenizer vocabulary; padded by Megatron to 128 (divisible-by 64 * TP)
ITERATIONS = 2
SEED = 1234

# Both models: 2 layers, hidden 32, 4 attention heads, norm epsilon 1e-5, no fused kernels.
COMMON = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
          "--norm-epsilon", "1e-5", "--no-persist-layer-norm"]  # fmt: skip
LLAMA = [*COMMON, "--group-query-attention", "--num-query-groups", "2",
         "--ffn-hidden-size", "64", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--rotary-base", "10000",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--no-rope-fusion", "--no-bias-swiglu-fusion"]  # fmt: skip
GPT2 = [*COMMON, "--ffn-hidden-size", "128", "--normalization", "LayerNorm",
        "--position-embedding-type", "learned_absolute", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion"]  # fmt: skip

# Mixture of experts on the Llama model: 4 experts of width 32, top-2, a gated shared expert
# of width 64, aux loss, every second layer (layer 0 MoE, layer 1 dense), the all-gather dispatcher
# (the all-to-all one needs CUDA streams; the checkpoint does not depend on it).
MOE = [*LLAMA, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
       "--moe-layer-freq", "2", "--moe-token-dispatcher-type", "allgather",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"]  # fmt: skip

# Megatron-LM's quantile balancing instead of the loss: the experts are the top 2 of the
# logits minus a per-expert bias (qb_beta, a checkpointed buffer) that each step sets from
# the micro-batches' column quantiles, half of the old one kept (EMA 0.5).
MOE_QUANTILE = [*MOE[: MOE.index("--moe-router-load-balancing-type")],
                "--moe-router-load-balancing-type", "quantile_balancing",
                "--moe-aux-loss-coeff", "0",
                "--moe-router-quantile-balancing-ema", "0.5"]  # fmt: skip

# The legacy MoE case routes with sigmoid scores and a learned-free expert bias.
MOE_SIGMOID = ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-bias-update-rate", "0.01")  # fmt: skip

# DeepSeek-shaped (multi-latent attention, DeepSeek's MoE), narrower than the others to keep
# the files small: hidden 16, 2 heads, vocabulary 60 padded to 64, the model only (no
# optimizer or RNG state saved), weights drawn with std 0.1 (logits that rotary or softmax
# scale errors move). Per head 8 + 4 (rotary) query/key channels and 8 value channels
# (kv_channels: the local core attention's output width), latents of 8. Layer 0 dense
# (DeepSeek's first dense layers), layer 1 MoE: 6 experts of width 8 in 2 groups, top-2 from
# the group whose best two score highest (group-limited: the top-2 of all may span groups),
# sigmoid scores with an expert bias, scaled by 2.5, an ungated shared expert of width 16,
# the sequence-level aux loss.
MLA = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
       "--norm-epsilon", "1e-5", "--no-persist-layer-norm", "--init-method-std", "0.1",
       "--multi-latent-attention", "--kv-lora-rank", "8", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
       "--ffn-hidden-size", "32", "--normalization", "RMSNorm", "--swiglu",
       "--position-embedding-type", "rope", "--rotary-base", "10000",
       "--untie-embeddings-and-output-weights", "--disable-bias-linear",
       "--no-rope-fusion", "--no-bias-swiglu-fusion",
       "--num-experts", "6", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "8",
       "--moe-shared-expert-intermediate-size", "16", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
       "--moe-router-topk", "2", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
       "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
       "--moe-token-dispatcher-type", "allgather",
       "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.001",
       "--vocab-size", "60", "--make-vocab-size-divisible-by", "32",
       "--no-save-optim", "--no-save-rng"]  # fmt: skip
# DeepSeek-V3's queries (a latent of q_lora_rank, linear_q_down_proj / q_layernorm /
# linear_q_up_proj), the latents normalized, with YaRN (MLA's default rope_type), whose
# mscale_all_dim scales the softmax too; and queries projected at once (linear_q_proj,
# DeepSeek-V2-Lite's) without latent norms (the local spec builds no kv_layernorm alone and
# refuses a q_layernorm without q_lora_rank), with plain RoPE.
MLA_Q_LORA_YARN = ("--q-lora-rank", "8", "--qk-layernorm", "--rotary-scaling-factor", "4",
                   "--mscale", "0.707", "--mscale-all-dim", "1.0")  # fmt: skip
MLA_ROPE = ("--rope-type", "rope")
# Megatron's default position_embedding_type (learned_absolute) under MLA: the learned table
# added to the embeddings, and MLA's own rotary channels still turned (YaRN here), as
# Megatron-LM's MLA functional test (gpt3_mcore_te_tp2_pp2_mla) trains.
_ROPE_AT = MLA.index("--position-embedding-type")
MLA_LEARNED = MLA[:_ROPE_AT] + MLA[_ROPE_AT + 2 :]
# Llama 4's features on the Llama model, 4 layers, weights drawn with std 0.1 (as MLA's):
# rotary pairs (2i, 2i+1) (--rotary-interleaved) with Llama 3's frequency scaling (factor 8,
# Llama 4's; Megatron-LM's gpt_builder passes --use-rope-scaling to GPTModel but not
# --rope-scaling-factor, so only GPTModel's default 8 is what Megatron computes), base
# 500000; no rotary embeddings on every second layer (--no-rope-freq 2: layers 2 and 4,
# 1-based); every layer's per-head queries and keys L2-normalized (weightless, eps = norm
# epsilon); MoE on layers 1 and 3 (--moe-layer-freq 2: Megatron's integer form, so the MoE
# layers keep their rotary embeddings and the dense ones have none): 4 experts of width 32,
# top-1 by sigmoid score, the score multiplying the expert's input
# (--moe-apply-probs-on-input), an ungated shared expert of width 32. The model only, as MLA's.
LLAMA4 = [*LLAMA, "--num-layers", "4", "--init-method-std", "0.1",  # (the last --num-layers wins)
          "--rotary-interleaved", "--rotary-base", "500000", "--use-rope-scaling",
          "--rope-scaling-factor", "8", "--no-rope-freq", "2", "--qk-l2-norm",
          "--num-experts", "4", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "32",
          "--moe-router-topk", "1", "--moe-router-score-function", "sigmoid",
          "--moe-apply-probs-on-input", "--moe-shared-expert-intermediate-size", "32",
          "--moe-token-dispatcher-type", "allgather",
          "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.001",
          "--no-save-optim", "--no-save-rng"]  # fmt: skip
# DeepSeek-V3.2's sparse attention on the DeepSeek-shaped model: each layer's lightning
# indexer (4 heads of 16 channels) chooses 6 of the 16 positions; the indexer loss trains it.
DSA = ("--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4",
       "--dsa-indexer-head-dim", "16", "--dsa-indexer-topk", "6",
       "--dsa-indexer-loss-coeff", "0.01")  # fmt: skip
# The DeepSeek-shaped model with its Adam and RNG states saved.
MLA_STATE = [a for a in MLA if a not in ("--no-save-optim", "--no-save-rng")]
# and with two load-balancing losses (Megatron's lists): the Switch-style one over the
# micro-batch (0.01) beside the sequence-level one (0.001), each with its own coefficient
_LOSS_AT = MLA_STATE.index("--moe-router-load-balancing-type")
MLA_TWO_LOSSES = [*MLA_STATE[:_LOSS_AT], "--moe-router-load-balancing-type", "aux_loss",
                  "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "0.001",
                  *MLA_STATE[_LOSS_AT + 4 :]]  # fmt: skip
# One multi-token prediction module (DeepSeek-V3's MTP), its layer shaped as the last (MoE).
MTP = ("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1")
# Megatron trains MoE under TP only with sequence parallelism
SP = ("--sequence-parallel",)

# Nemotron-H-shaped hybrid (megatron-core's HybridModel, hybrid.py): a Mamba layer, an
# attention layer, a squared-ReLU MLP layer and a MoE layer ("M*-E"), no positional
# embeddings, weights drawn with std 0.1 (as MLA's). Mamba mixers of 8 heads of 8 channels
# (inner width 64) in 2 groups, state size 8; attention 4 heads in 2 query groups; MoE of
# 4 squared-ReLU experts of width 32, top-2 by sigmoid score with an expert bias, scaled
# by 2, beside an ungated shared expert of width 32 (Nemotron 3's routing). The model only.
HYBRID = ["--num-layers", "4", "--hybrid-layer-pattern", "M*-E", "--hidden-size", "32",
          "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
          "--ffn-hidden-size", "64", "--squared-relu", "--normalization", "RMSNorm",
          "--norm-epsilon", "1e-5", "--no-persist-layer-norm", "--init-method-std", "0.1",
          "--position-embedding-type", "none", "--untie-embeddings-and-output-weights",
          "--disable-bias-linear", "--mamba-num-heads", "8", "--mamba-head-dim", "8",
          "--mamba-num-groups", "2", "--mamba-state-dim", "8", "--disable-mamba-mem-eff-path",
          "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
          "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
          "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
          "--moe-router-topk-scaling-factor", "2.0", "--moe-router-dtype", "fp32",
          "--moe-token-dispatcher-type", "allgather",
          "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.001",
          "--no-save-optim", "--no-save-rng"]  # fmt: skip
# The hybrid with a gated DeltaNet (Megatron's G: 2 key heads of 8, 4 value heads of 8) in
# place of its MLP layer: "MG*E" (gdn.py's stand-ins for FLA's kernels), its experts SwiGLU
# (megatron-core's GatedDeltaNet convolves with the model's activation and accepts silu
# alone). The model only.
HYBRID_GDN = [*(a if a != "--squared-relu" else "--swiglu" for a in HYBRID),
              "--hybrid-layer-pattern", "MG*E", "--linear-conv-kernel-dim", "4",
              "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
              "--linear-num-key-heads", "2", "--linear-num-value-heads", "4"]  # fmt: skip
# The hybrid trained with the distributed optimizer, its Adam state and RNG state saved.
HYBRID_STATE = [a for a in HYBRID if a not in ("--no-save-optim", "--no-save-rng")]
# The hybrid with two multi-token prediction modules of an attention, a Mamba and a MoE
# layer each (Megatron-LM's unified pattern; --mtp-num-layers follows it), loss scale 0.1.
HYBRID_MTP = ("--hybrid-layer-pattern", "M*-E/*ME/*ME", "--mtp-num-layers", "2",
              "--mtp-loss-scaling-factor", "0.1")  # fmt: skip

# Qwen3-Next-shaped (gated DeltaNet layers, gdn.py): layer 0 a gated DeltaNet (2 key heads
# of 8 channels, 4 value heads of 8, convolution width 4), layer 1 softmax attention with an
# output gate and per-head query/key norms, half of each head rotated; layer 0's
# MLP a MoE (4 experts of width 32, top-2 of the softmax, a gated shared expert of width
# 64), layer 1's dense; weights drawn with std 0.1 (as MLA's). Megatron's torch norm has no
# zero-centred gamma (Qwen3-Next's --apply-layernorm-1p): plain RMSNorm. The model only.
QWEN3_NEXT = [*LLAMA, "--init-method-std", "0.1", "--rotary-percent", "0.5",
              "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
              "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "8",
              "--linear-value-head-dim", "8", "--linear-num-key-heads", "2",
              "--linear-num-value-heads", "4", "--attention-output-gate", "--qk-layernorm",
              "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
              "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
              "--moe-layer-freq", "2", "--moe-token-dispatcher-type", "allgather",
              "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01",
              "--no-save-optim", "--no-save-rng"]  # fmt: skip

# The Qwen3-Next-shaped model with its Adam and RNG states saved.
QWEN3_NEXT_STATE = [a for a in QWEN3_NEXT if a not in ("--no-save-optim", "--no-save-rng")]

# Megatron's Muon (megatron-core's TensorParallelMuon over emerging-optimizers) for the
# matrices, Adam for the embedding, the output layer and the norms, as Megatron routes
# them; Megatron's Muon defaults (momentum 0.9, no Nesterov, quintic coefficients, 5
# iterations, spectral scale, split QKV) except the tensor-parallel mode (duplicated, not
# 0.19.2's default blockwise: the update of a split matrix is then the whole matrix's, at
# any TP size) and fp32 iterations (not "medium", bf16 ones), so that the step after the
# save does not depend on the TP size. Needs emerging-optimizers (README.md).
MUON = ("--optimizer", "muon", "--muon-tp-mode", "duplicated", "--muon-fp32-matmul-prec", "high")

# μP (Maximal Update Parameterization) on the Llama model: base width 16 (hidden 32: width
# multiplier 2), so the logits are multiplied by 0.5 (megatron-core sets mup_output_mult to
# 1 / width multiplier), the word embeddings' output by 2, the softmax scale is
# sqrt(4) / 8 = 0.25 (base head dim 4, attention scale power 1), weights drawn with
# megatron-core's μP init from std 0.1; the optimizer built as Megatron-LM's training loop
# builds it under --use-mup (the hidden matrices' Adam lr and eps halved, README.md "μP").
MUP = [*LLAMA, "--use-mup", "--mup-base-hidden-size", "16", "--mup-embedding-mult", "2.0",
       "--mup-base-head-dim", "4", "--init-method-std", "0.1"]  # fmt: skip

# Several distributed-optimizer buckets per grad buffer: Megatron-LM's training loop keeps
# --ddp-bucket-size only with --overlap-grad-reduce (otherwise one bucket per buffer).
BUCKETS = ("--overlap-grad-reduce", "--ddp-bucket-size", "2000")
# Cases whose reference.pt also records one more training step on NEXT_BATCH_SEED's batch,
# taken after the save and after everything else is recorded (the rest stays the same).
NEXT_STEP = {"llama_torch_dist_tp2_distopt", "hybrid_torch_dist_tp2_dp2_distopt",
             "mla_mtp_torch_dist_tp1_distopt", "qwen3_next_torch_dist_tp2_dp2_distopt",
             "mla_two_losses_torch_dist_tp1_distopt", "mla_dsa_torch_dist_tp1_distopt",
             "llama_muon_torch_dist_tp2", "llama_mup_torch_tp2"}  # fmt: skip
NEXT_BATCH_SEED = 11


class Case(NamedTuple):
    model: list  # the model's Megatron flags
    fmt: str  # --ckpt-format
    tp: int
    pp: int
    dist_opt: bool
    dp: int = 1  # data-parallel size: the run has tp * pp * dp ranks
    ep: int = 1  # expert-parallel size (divides dp * tp)
    extra: tuple = ()  # more Megatron flags (bucket size, experts, ...)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


CASES = {
    "llama_torch_dist_tp1": Case(LLAMA, "torch_dist", 1, 1, False),
    "llama_torch_dist_tp2_distopt": Case(LLAMA, "torch_dist", 2, 1, True),
    "llama_torch_tp2": Case(LLAMA, "torch", 2, 1, False),
    # 4 ranks over the 2 query groups: Megatron-LM shares each group between two ranks, each
    # rank's file a contiguous quarter of the fused QKV weight (half a group)
    "llama_torch_tp4": Case(LLAMA, "torch", 4, 1, False),
    "gpt2_torch_dist_tp1": Case(GPT2, "torch_dist", 1, 1, False),
    "llama_torch_pp2": Case(LLAMA, "torch", 1, 2, False),
    "moe_torch_dist_ep2": Case(MOE, "torch_dist", 1, 1, False, dp=2, ep=2),
    "moe_torch_ep2": Case(MOE, "torch", 1, 1, False, dp=2, ep=2, extra=MOE_SIGMOID),
    "moe_quantile_torch_dist_ep2": Case(MOE_QUANTILE, "torch_dist", 1, 1, False, dp=2, ep=2),
    # 4 ranks; buckets of ~2000 elements (Megatron buckets only with --overlap-grad-reduce)
    "llama_torch_dist_pp2_dp2_distopt": Case(LLAMA, "torch_dist", 1, 2, True, dp=2, extra=BUCKETS),
    "llama_torch_pp2_dp2_distopt": Case(LLAMA, "torch", 1, 2, True, dp=2, extra=BUCKETS),
    "llama_torch_dist_tp2_dp2_distopt": Case(LLAMA, "torch_dist", 2, 1, True, dp=2, extra=BUCKETS),
    "mla_moe_torch_dist_tp2": Case(MLA, "torch_dist", 2, 1, False, extra=(*MLA_Q_LORA_YARN, *SP)),
    "mla_dsa_torch_dist_tp1": Case(MLA, "torch_dist", 1, 1, False, extra=(*MLA_Q_LORA_YARN, *DSA)),
    "mla_learned_positions_torch_dist_tp1": Case(
        MLA_LEARNED, "torch_dist", 1, 1, False, extra=MLA_Q_LORA_YARN
    ),
    # 4 ranks: TP2 x DP2, the experts over EP2 (each EP rank's experts split over TP2)
    "mla_moe_mtp_torch_tp2_ep2": Case(
        MLA, "torch", 2, 1, False, dp=2, ep=2, extra=(*MLA_ROPE, *MTP, *SP)
    ),
    # TP2 with sequence parallelism (Megatron's MoE under TP), the experts split over the
    # expert TP (= TP 2): the query/key norms then see each TP rank's own heads
    "llama4_moe_torch_dist_tp2": Case(LLAMA4, "torch_dist", 2, 1, False, extra=SP),
    # The DeepSeek-shaped model with one MTP module and its Adam state: the distributed
    # optimizer at TP2 x DP2 in buckets and at TP1 (torch_dist), and the plain one (legacy)
    "mla_mtp_torch_dist_tp2_dp2_distopt": Case(
        MLA_STATE, "torch_dist", 2, 1, True, dp=2, extra=(*MLA_Q_LORA_YARN, *MTP, *SP, *BUCKETS)
    ),
    "mla_mtp_torch_dist_tp1_distopt": Case(
        MLA_STATE, "torch_dist", 1, 1, True, extra=(*MLA_Q_LORA_YARN, *MTP)
    ),
    "mla_two_losses_torch_dist_tp1_distopt": Case(
        MLA_TWO_LOSSES, "torch_dist", 1, 1, True, extra=(*MLA_Q_LORA_YARN, *MTP)
    ),
    # with DeepSeek's sparse attention (the MTP module's layer has an indexer too)
    "mla_dsa_torch_dist_tp1_distopt": Case(
        MLA_STATE, "torch_dist", 1, 1, True, extra=(*MLA_Q_LORA_YARN, *MTP, *DSA)
    ),
    "mla_mtp_optim_torch_tp2": Case(MLA_STATE, "torch", 2, 1, False, extra=(*MLA_ROPE, *MTP, *SP)),
    # the hybrid at TP2 (sequence parallelism: MoE under TP) in both formats
    "hybrid_torch_dist_tp2": Case(HYBRID, "torch_dist", 2, 1, False, extra=SP),
    "hybrid_torch_tp2": Case(HYBRID, "torch", 2, 1, False, extra=SP),
    "hybrid_mtp_torch_dist_tp2": Case(HYBRID, "torch_dist", 2, 1, False, extra=(*HYBRID_MTP, *SP)),
    # 4 ranks: TP2 x DP2, the distributed optimizer in several buckets
    "hybrid_torch_dist_tp2_dp2_distopt": Case(
        HYBRID_STATE, "torch_dist", 2, 1, True, dp=2, extra=(*SP, *BUCKETS)
    ),
    # its Adam state without the distributed optimizer (2 ranks, TP2)
    "hybrid_optim_torch_dist_tp2": Case(HYBRID_STATE, "torch_dist", 2, 1, False, extra=SP),
    "hybrid_optim_torch_tp2": Case(HYBRID_STATE, "torch", 2, 1, False, extra=SP),
    "hybrid_torch_tp2_dp2_distopt": Case(
        HYBRID_STATE, "torch", 2, 1, True, dp=2, extra=(*SP, *BUCKETS)
    ),
    "hybrid_mtp_torch_tp2": Case(HYBRID, "torch", 2, 1, False, extra=(*HYBRID_MTP, *SP)),
    # the hybrid with a gated DeltaNet layer at TP2, both formats
    "hybrid_gdn_torch_dist_tp2": Case(HYBRID_GDN, "torch_dist", 2, 1, False, extra=SP),
    "hybrid_gdn_torch_tp2": Case(HYBRID_GDN, "torch", 2, 1, False, extra=SP),
    # the Qwen3-Next-shaped model at TP2 (sequence parallelism: MoE under TP), both formats
    "qwen3_next_torch_dist_tp2": Case(QWEN3_NEXT, "torch_dist", 2, 1, False, extra=SP),
    "qwen3_next_torch_tp2": Case(QWEN3_NEXT, "torch", 2, 1, False, extra=SP),
    # with one multi-token prediction module (its layer shaped as the last: gated attention)
    "qwen3_next_mtp_torch_dist_tp2": Case(QWEN3_NEXT, "torch_dist", 2, 1, False, extra=(*MTP, *SP)),
    # its Adam state: without the distributed optimizer (legacy), and with it at TP2 x DP2
    # in several buckets (torch_dist)
    "qwen3_next_optim_torch_tp2": Case(QWEN3_NEXT_STATE, "torch", 2, 1, False, extra=SP),
    "qwen3_next_torch_dist_tp2_dp2_distopt": Case(
        QWEN3_NEXT_STATE, "torch_dist", 2, 1, True, dp=2, extra=(*SP, *BUCKETS)
    ),
    # the Llama model trained with Muon (its matrices) and Adam (the rest), TP2, without the
    # distributed optimizer (with it Megatron's Muon is its layer-wise optimizer)
    "llama_muon_torch_dist_tp2": Case(LLAMA, "torch_dist", 2, 1, False, extra=MUON),
    # the Llama model under μP, its Adam state, TP2, legacy format
    "llama_mup_torch_tp2": Case(MUP, "torch", 2, 1, False),
}
