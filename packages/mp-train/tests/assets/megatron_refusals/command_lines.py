"""The command lines of cases.json (generate.py writes it): BASE, a small GPT on mock
data, then each case's flags at a world size. Read by generate.py only."""

from __future__ import annotations

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --lr 1e-3 --no-rope-fusion "
    "--tokenizer-type NullTokenizer --vocab-size 1000"
)
TRAINING = "--train-iters 10"
"""Added to a case that names neither --train-iters nor --train-samples."""
DATA = "--mock-data"
"""Added to a case that names no data source."""
DATA_FLAGS = ("--mock-data", "--data-path", "--train-data-path", "--data-args-path",
              "--per-split-data-args-path")  # fmt: skip
MOE = "--num-experts 4 --moe-ffn-hidden-size 32 --disable-bias-linear"
HYBRID = "--hybrid-layer-pattern M*M* --mamba-num-heads 8 --mamba-head-dim 16"
MLA = (
    "--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 16 --position-embedding-type rope"
)
PP2 = "--pipeline-model-parallel-size 2"
TP2 = "--tensor-model-parallel-size 2"
FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
# Megatron's gradient-accumulation fusion (on by default) is refused under FSDP2.
FSDP2 = "--use-torch-fsdp2 --untie-embeddings-and-output-weights --no-gradient-accumulation-fusion"

# (name, flags added to BASE, world size)
CASES = [
    # --- the base itself, and the layout's arithmetic
    ("base", "", 1),
    ("world-not-divisible-by-model-size", TP2, 3),
    ("tp-does-not-divide-heads", "--tensor-model-parallel-size 3", 3),
    ("sequence-parallel-at-tp1", "--sequence-parallel", 1),
    ("layers-not-divisible-by-pp", f"{PP2} --num-layers 3", 2),
    ("layers-with-embedding-not-divisible-by-pp",
     f"{PP2} --account-for-embedding-in-pipeline-split", 2),
    ("layers-with-embedding-and-loss-divisible-by-pp",
     f"{PP2} --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 2),
    ("uneven-first-and-last-stages",
     f"{PP2} --num-layers 5 --decoder-first-pipeline-num-layers 2", 2),
    # --- virtual pipeline stages
    ("vpp-at-pp2", f"{PP2} --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4", 2),
    ("vpp-at-pp4", "--pipeline-model-parallel-size 4 --num-layers 8 "
     "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4", 4),
    ("vpp-layers-not-dividing-a-stage",
     f"{PP2} --num-layers 6 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 4", 2),
    ("vpp-layers-and-stages-both",
     f"{PP2} --num-layers-per-virtual-pipeline-stage 1 --num-virtual-stages-per-pipeline-rank 2",
     2),
    ("vpp-layers-with-uneven-stages", f"{PP2} --num-layers 6 "
     "--num-layers-per-virtual-pipeline-stage 1 --decoder-first-pipeline-num-layers 2", 2),
    ("vpp-stages-with-uneven-stages", f"{PP2} --num-layers 6 --num-virtual-stages-per-pipeline-rank"
     " 2 --decoder-first-pipeline-num-layers 2 --global-batch-size 4", 2),
    ("layout-and-vpp-layers", f"{PP2} --pipeline-model-parallel-layout Et|tt|t|tL "
     "--num-layers-per-virtual-pipeline-stage 1", 2),
    ("layout-stages-not-divisible-by-pp", f"{PP2} --pipeline-model-parallel-layout Ett|t|tL", 2),
    ("vpp-microbatches-not-a-multiple-of-pp",
     f"{PP2} --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 3", 2),
    ("vpp-without-pipeline", "--num-layers-per-virtual-pipeline-stage 1", 1),
    ("vpp-at-pp2-without-p2p-overlap", f"{PP2} --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 4 --no-overlap-p2p-communication", 2),
    ("vpp-at-pp4-without-p2p-overlap", "--pipeline-model-parallel-size 4 --num-layers 8 "
     "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4 "
     "--no-overlap-p2p-communication", 4),
    ("p2p-overlap-in-warmup-and-flush", f"{PP2} --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 4 --overlap-p2p-communication-warmup-flush", 2),
    ("p2p-overlap-in-warmup-and-flush-without-vpp",
     f"{PP2} --overlap-p2p-communication-warmup-flush", 2),
    ("p2p-overlap-in-warmup-and-flush-without-overlap", f"{PP2} "
     "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4 "
     "--overlap-p2p-communication-warmup-flush --no-overlap-p2p-communication", 2),
    # --- batch sizes
    ("global-batch-not-divisible", f"{TP2} --global-batch-size 3", 4),
    ("eval-global-batch-not-divisible", "--eval-global-batch-size 3", 2),
    ("step-batch-schedule-and-global-batch",
     "--step-batch-size-schedule 0:2,5:4 --global-batch-size 4", 2),
    ("zero-micro-batch", "--micro-batch-size 0", 1),
    # --- deprecated and removed flags
    ("batch-size", "--batch-size 2", 1),
    ("warmup", "--warmup 2", 1),
    ("model-parallel-size", "--model-parallel-size 2", 2),
    ("checkpoint-activations", "--checkpoint-activations", 1),
    ("no-position-embedding", "--no-position-embedding", 1),
    # --- data sources
    ("data-path-and-data-args-path", "--data-path a --data-args-path b", 1),
    ("split-paths-and-split-args-path", "--train-data-path a --per-split-data-args-path b", 1),
    ("mock-data-and-data-path", "--mock-data --data-path a", 1),
    ("fim-without-rate", "--data-path a --fim-data", 1),
    # --- hybrid models
    ("hybrid-both-patterns", f"{HYBRID} --hybrid-override-pattern M*M*", 1),
    ("hybrid-pattern-with-pipes-and-first-stage",
     "--hybrid-layer-pattern M*|M* --mamba-num-heads 8 --mamba-head-dim 16 "
     f"{PP2} --decoder-first-pipeline-num-layers 2", 2),
    ("hybrid-and-vpp-layers", f"{HYBRID} {PP2} --num-layers-per-virtual-pipeline-stage 1", 2),
    ("hybrid-and-vpp-stages", f"{HYBRID} {PP2} --num-virtual-stages-per-pipeline-rank 2", 2),
    ("hybrid-and-layout", f"{HYBRID} {PP2} --pipeline-model-parallel-layout Et|tL", 2),
    ("hybrid-and-embedding-in-split",
     f"{HYBRID} {PP2} --account-for-embedding-in-pipeline-split", 2),
    ("hybrid-and-loss-in-split", f"{HYBRID} {PP2} --account-for-loss-in-pipeline-split", 2),
    ("hybrid-segments-not-divisible-by-pp",
     "--hybrid-layer-pattern M*|M*|M* --mamba-num-heads 8 --mamba-head-dim 16 "
     f"{PP2}", 2),
    ("hybrid-segments-as-virtual-stages",
     "--hybrid-layer-pattern M|*|M|* --mamba-num-heads 8 --mamba-head-dim 16 "
     f"{PP2} --global-batch-size 4", 2),
    # --- multi-token prediction
    ("mtp-with-learned-positions", "--mtp-num-layers 1", 1),
    ("mtp-with-rope", "--mtp-num-layers 1 --position-embedding-type rope", 1),
    # --- optimizer and gradient reduction
    ("overlap-param-gather-without-distopt", "--overlap-param-gather --overlap-grad-reduce", 2),
    ("overlap-param-gather-without-overlap-grad-reduce",
     "--overlap-param-gather --use-distributed-optimizer", 2),
    ("torch-fsdp2-with-pp", f"{FSDP2} {PP2}", 4),
    ("megatron-fsdp", FSDP, 2),
    ("megatron-fsdp-fsdp-dtensor", f"{FSDP} --ckpt-format fsdp_dtensor", 2),
    ("megatron-fsdp-with-muon", f"{FSDP} --ckpt-format fsdp_dtensor --optimizer muon", 2),
    ("megatron-fsdp-meta-init-no-shard", "--use-megatron-fsdp --data-parallel-sharding-strategy "
     "no_shard --ckpt-format fsdp_dtensor --init-model-with-meta-device", 2),
    ("fp16-and-bf16", "--fp16 --bf16", 1),
    ("bf16-fp32-accumulation-and-bf16-main-grads",
     "--bf16 --accumulate-allreduce-grads-in-fp32 --main-grads-dtype bf16 "
     "--use-precision-aware-optimizer --use-distributed-optimizer", 2),
    ("fp16-lm-cross-entropy-without-fp16", "--fp16-lm-cross-entropy", 1),
    ("fp32-residual-connection-in-fp32", "--fp32-residual-connection", 1),
    ("optimizer-cpu-offload-without-precision-aware", "--optimizer-cpu-offload "
     "--use-distributed-optimizer", 2),
    ("muon-with-distributed-optimizer", "--optimizer muon --use-distributed-optimizer", 2),
    ("load-main-params-without-no-load-optim", "--load-main-params-from-ckpt", 1),
    ("overlap-param-gather-with-optimizer-step-without-vpp",
     "--overlap-param-gather-with-optimizer-step --overlap-param-gather --overlap-grad-reduce "
     "--use-distributed-optimizer", 2),
    # --- schedules of the learning rate and of training
    ("iterations-and-samples", "--train-iters 10 --train-samples 100", 1),
    ("iterations-with-decay-samples", "--lr-decay-samples 100", 1),
    ("iterations-with-warmup-samples", "--lr-warmup-samples 10", 1),
    ("warmup-fraction-and-iterations", "--lr-warmup-fraction 0.1 --lr-warmup-iters 2", 1),
    ("samples-with-decay-iterations", "--train-samples 100 --lr-decay-iters 5", 1),
    ("min-lr-above-lr", "--min-lr 1e-2", 1),
    ("weight-decay-schedule-without-ends", "--weight-decay-incr-style linear", 1),
    ("constant-weight-decay-with-ends", "--start-weight-decay 0.1 --end-weight-decay 0.2", 1),
    # --- sequence and positions
    ("positions-shorter-than-sequence", "--max-position-embeddings 16", 1),
    ("cp-sequence-not-a-multiple-of-2cp", "--context-parallel-size 2 --seq-length 34 "
     "--max-position-embeddings 34 --attention-dropout 0", 2),
    ("kv-channels-from-indivisible-heads", "--num-attention-heads 3", 1),
    ("mrope-without-sections", "--position-embedding-type mrope", 1),
    # --- recomputation
    ("distribute-saved-activations-at-tp1", "--distribute-saved-activations "
     "--recompute-granularity full --recompute-method uniform", 1),
    ("distribute-saved-activations-selective", f"{TP2} --distribute-saved-activations "
     "--recompute-granularity selective", 2),
    ("selective-with-method", "--recompute-granularity selective --recompute-method uniform", 1),
    ("recompute-method-without-granularity", "--recompute-method uniform", 1),
    ("recompute-layers-without-granularity", "--recompute-num-layers 1", 1),
    ("full-without-method", "--recompute-granularity full", 1),
    # --- saving and logging
    ("save-without-interval", "--save /tmp/x", 1),
    ("save-retain-interval-not-a-multiple", "--save /tmp/x --save-interval 4 "
     "--save-retain-interval 6", 1),
    ("log-memory-interval-not-a-multiple", "--log-memory-interval 3 --log-interval 2", 1),
    ("override-iteration-with-finetune", "--override-ckpt-iteration 5 --finetune", 1),
    # --- experts
    ("ep-without-experts", "--expert-model-parallel-size 2", 2),
    ("experts-not-divisible-by-ep", f"{MOE} --num-experts 3 --expert-model-parallel-size 2", 2),
    ("zero-experts", "--num-experts 0", 1),
    ("moe-latent-without-experts", "--moe-latent-size 16", 1),
    ("experts-with-bias", "--num-experts 4 --moe-ffn-hidden-size 32", 1),
    ("moe-router-topk-above-experts", f"{MOE} --moe-router-topk 5", 1),
    ("moe-aux-loss-and-seq-aux-loss", f"{MOE} --moe-router-load-balancing-type aux_loss "
     "seq_aux_loss", 1),
    ("moe-expert-capacity-without-drop", f"{MOE} --moe-expert-capacity-factor 1.0", 1),
    ("moe-pad-to-capacity-without-factor", f"{MOE} --moe-pad-expert-input-to-capacity", 1),
    ("moe-group-topk-without-groups", f"{MOE} --moe-router-group-topk 2", 1),
    ("moe-shared-expert-not-a-multiple", f"{MOE} --moe-shared-expert-intermediate-size 40", 1),
    ("moe-layer-freq-list-of-wrong-length", f"{MOE} --moe-layer-freq [1,0,1]", 1),
    ("moe-router-bias-without-sigmoid", f"{MOE} --moe-router-enable-expert-bias", 1),
    ("moe-allgather-dispatcher-with-capacity", f"{MOE} --moe-token-dispatcher-type allgather "
     "--moe-expert-capacity-factor 1.0", 1),
    ("etp-with-ep-and-tp", f"{MOE} {TP2} --expert-model-parallel-size 2 "
     "--expert-tensor-parallel-size 1 --sequence-parallel", 4),
    ("moe-without-sp-at-tp2", f"{MOE} {TP2}", 2),
    # --- attention
    ("mla-with-gqa", f"{MLA} --group-query-attention --num-query-groups 2", 1),
    ("gqa-groups-not-dividing-heads", "--group-query-attention --num-query-groups 3", 1),
    ("gqa-groups-not-divisible-by-tp", f"{TP2} --group-query-attention --num-query-groups 1", 2),
    ("qk-clip-alpha-out-of-range", "--qk-clip --qk-clip-alpha 1.5", 1),
    ("attention-backend-local", "--attention-backend local", 1),
    ("sliding-window-with-flash", "--window-size 8,0 --attention-backend flash", 1),
    ("softmax-learnable-with-flash", "--softmax-type learnable --attention-backend flash", 1),
    ("rotary-percent-above-one", "--position-embedding-type rope --rotary-percent 1.5", 1),
    ("kv-channels-and-heads-at-odd-width", "--kv-channels 24", 1),
    ("swiglu-with-squared-relu", "--swiglu --squared-relu", 1),
    ("apply-layernorm-1p-with-rmsnorm", "--apply-layernorm-1p --normalization RMSNorm", 1),
    ("qk-layernorm-with-mla", f"{MLA} --qk-layernorm", 1),
    # --- context parallelism
    ("cp-a2a-with-heads-not-divisible", "--context-parallel-size 4 --cp-comm-type a2a "
     "--num-attention-heads 2 --hidden-size 64", 4),
    ("cp-with-sliding-window", "--context-parallel-size 2 --window-size 8,0", 2),
    ("cp-with-attention-dropout", "--context-parallel-size 2 --attention-dropout 0.1", 2),
    # --- precision and data types
    ("fp8-recipe-without-format", "--fp8-recipe tensorwise", 1),
    ("fp8-with-fp16", "--fp8-format hybrid --fp16", 1),
    ("main-params-fp16-without-precision-aware", "--main-params-dtype fp16", 1),
    ("exp-avg-dtype-bf16-without-precision-aware", "--exp-avg-dtype bf16", 1),
    # --- checkpoint formats and loading
    ("ckpt-format-torch-dcp-without-fsdp2", "--ckpt-format torch_dcp", 1),
    ("ckpt-format-fsdp-dtensor-without-fsdp", "--ckpt-format fsdp_dtensor", 1),
    ("non-persistent-local", "--non-persistent-ckpt-type local", 1),
    # --- TransformerConfig's model rules
    ("squared-relu", "--squared-relu", 1),
    ("squared-relu-without-bias", "--squared-relu --disable-bias-linear", 1),
    ("moe-ffn-size-without-experts", "--moe-ffn-hidden-size 32", 1),
    ("moe-ffn-size-without-experts-in-a-mixed-model", "--moe-ffn-hidden-size 32 "
     "--moe-layer-freq 2", 1),
    ("moe-top1-without-pre-softmax", f"{MOE} --moe-router-topk 1", 1),
    ("moe-top1-with-pre-softmax", f"{MOE} --moe-router-topk 1 --moe-router-pre-softmax", 1),
    ("moe-groups-not-dividing-experts", f"{MOE} --moe-router-num-groups 3 "
     "--moe-router-group-topk 1", 1),
    ("moe-group-topk-above-groups", f"{MOE} --moe-router-num-groups 2 --moe-router-group-topk 3",
     1),
    ("moe-capacity-with-sinkhorn", f"{MOE} --moe-router-load-balancing-type sinkhorn "
     "--moe-expert-capacity-factor 1.0", 1),
    ("moe-bias-with-etp2", "--num-experts 4 --moe-ffn-hidden-size 32 "
     f"{TP2} --sequence-parallel", 2),
    ("moe-aux-loss-coefficients-per-type", f"{MOE} --moe-router-load-balancing-type aux_loss "
     "seq_aux_loss --moe-aux-loss-coeff 0.01 0.001", 1),
    ("moe-router-bias-with-sigmoid", f"{MOE} --moe-router-enable-expert-bias "
     "--moe-router-score-function sigmoid", 1),
    ("recompute-layers-above-the-stage", "--recompute-granularity full --recompute-method "
     "uniform --recompute-num-layers 5", 1),
    ("recompute-layers-with-selective", "--recompute-granularity selective "
     "--recompute-num-layers 1", 1),
    ("recompute-unknown-module", "--recompute-granularity selective --recompute-modules foo", 1),
    ("recompute-mla-up-proj-without-mla", "--recompute-granularity selective "
     "--recompute-modules mla_up_proj", 1),
    ("recompute-moe-act-without-grouped-gemm", f"{MOE} --recompute-granularity selective "
     "--recompute-modules moe_act", 1),
    ("moe-layer-recompute-with-full", f"{MOE} --moe-layer-recompute --recompute-granularity full "
     "--recompute-method uniform --recompute-num-layers 1", 1),
    ("distribute-saved-activations-with-sp", f"{TP2} --sequence-parallel "
     "--distribute-saved-activations --recompute-granularity full --recompute-method uniform", 2),
    ("first-and-last-stages-with-accounting", f"{PP2} --num-layers 5 "
     "--decoder-first-pipeline-num-layers 2 --account-for-embedding-in-pipeline-split", 2),
    ("first-stage-of-no-layers", f"{PP2} --decoder-first-pipeline-num-layers 0", 2),
    ("middle-stages-not-even", "--pipeline-model-parallel-size 4 --num-layers 7 "
     "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1", 4),
    ("uneven-stages-not-divisible-by-vpp", "--pipeline-model-parallel-size 2 --num-layers 6 "
     "--decoder-first-pipeline-num-layers 3 --num-virtual-stages-per-pipeline-rank 2", 2),
    ("rotary-interleaved-with-mla", f"{MLA} --rotary-interleaved", 1),
    ("gated-delta-net-without-its-sizes", "--experimental-attention-variant gated_delta_net "
     "--linear-attention-freq 2", 1),
    ("gated-delta-net-value-heads-not-a-multiple", "--swiglu --experimental-attention-variant "
     "gated_delta_net --linear-attention-freq 2 --linear-conv-kernel-dim 4 "
     "--linear-key-head-dim 16 --linear-value-head-dim 16 --linear-num-key-heads 4 "
     "--linear-num-value-heads 6", 1),
    ("gated-delta-net-heads-not-divisible-by-tp", f"{TP2} --swiglu "
     "--experimental-attention-variant "
     "gated_delta_net --linear-attention-freq 2 --linear-conv-kernel-dim 4 "
     "--linear-key-head-dim 16 --linear-value-head-dim 16 --linear-num-key-heads 1 "
     "--linear-num-value-heads 2", 2),
    ("mup-base-width-zero", "--use-mup --mup-base-hidden-size 0", 1),
    ("fp8-param-gather-without-fp8", "--fp8-param-gather", 1),
    ("num-layers-at-start-in-bf16-above-stage", "--fp8-format hybrid --fp8-recipe tensorwise "
     "--bf16 --first-last-layers-bf16 --num-layers-at-start-in-bf16 5", 1),
    ("first-last-layers-bf16-with-delayed-scaling", "--fp8-format hybrid --bf16 "
     "--fp8-recipe delayed --first-last-layers-bf16", 1),
    # --- a few more of validate_args' rules
    ("cp-sequence-a-multiple-of-2cp", "--context-parallel-size 2 --attention-dropout 0", 2),
    ("cp-with-sliding-window-without-dropout", "--context-parallel-size 2 --attention-dropout 0 "
     "--window-size 8,0", 2),
    ("tp-comm-overlap-without-sp", f"{TP2} --tp-comm-overlap", 2),
    ("qk-clip-alpha-in-range", "--qk-clip --qk-clip-alpha 0.5 --qk-clip-threshold 100", 1),
    ("qk-clip-threshold-zero", "--qk-clip --qk-clip-alpha 0.5 --qk-clip-threshold 0", 1),
    ("logits-save-dir-without-top-k", "--logits-save-dir /tmp/x", 1),
    ("decoupled-lr-with-muon", "--optimizer muon --decoupled-lr 1e-3", 1),
    ("eval-micro-batch-not-dividing", "--eval-micro-batch-size 2 --eval-global-batch-size 3", 1),
    ("rampup-and-step-schedule", "--rampup-batch-size 2 2 10 --step-batch-size-schedule 0:2",
     1),
    ("rampup-with-samples", "--train-samples 100 --rampup-batch-size 2 2 10 "
     "--global-batch-size 8", 2),
    ("decrease-batch-size-if-needed", "--global-batch-size 6 --decrease-batch-size-if-needed",
     4),
    ("decrease-batch-size-if-needed-with-eval-batch", "--global-batch-size 6 "
     "--decrease-batch-size-if-needed --eval-global-batch-size 4", 4),
    ("full-uniform-without-layers", "--recompute-granularity full --recompute-method uniform",
     1),
    ("gated-delta-net-with-swiglu-without-its-sizes", "--swiglu --experimental-attention-variant "
     "gated_delta_net --linear-attention-freq 2", 1),
    ("apply-query-key-layer-scaling", "--apply-query-key-layer-scaling --fp16", 1),
    ("relative-positions", "--position-embedding-type relative", 1),
    ("mtp-with-yarn", "--mtp-num-layers 1 --position-embedding-type yarn", 1),
    ("mtp-without-positions", "--mtp-num-layers 1 --position-embedding-type none", 1),
    ("moe-upcycling-without-save", f"{MOE} --moe-use-upcycling", 1),
    ("deterministic-with-cross-entropy-fusion", "--deterministic-mode "
     "--cross-entropy-loss-fusion", 1),
    ("muon-under-torch-fsdp2", f"--optimizer muon {FSDP2}", 2),
    ("muon-with-fp16", "--optimizer muon --fp16", 1),
    ("torch-fsdp2", FSDP2, 2),
    ("torch-fsdp2-with-distopt", f"{FSDP2} --use-distributed-optimizer", 2),
    ("torch-fsdp2-with-fp16", f"{FSDP2} --fp16", 2),
    ("torch-fsdp2-tied-embeddings", "--use-torch-fsdp2 --no-gradient-accumulation-fusion", 2),
    ("torch-fsdp2-with-ep", f"{MOE} {FSDP2} --expert-model-parallel-size 2", 2),
    ("megatron-fsdp-and-torch-fsdp2", f"{FSDP} --ckpt-format fsdp_dtensor --use-torch-fsdp2 "
     "--no-gradient-accumulation-fusion", 2),
    ("megatron-fsdp-meta-init", f"{FSDP} --ckpt-format fsdp_dtensor "
     "--init-model-with-meta-device", 2),
    ("yarn-positions", "--position-embedding-type yarn --rotary-scaling-factor 4", 1),
    ("mla-without-rope", "--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 "
     "--qk-pos-emb-head-dim 8 --v-head-dim 16", 1),
    ("sequence-packing-with-micro-batch-2", "--micro-batch-size 2 --reset-attention-mask "
     "--reset-position-ids", 1),
    ("calculate-per-token-loss-with-cp", "--calculate-per-token-loss --context-parallel-size 2 "
     "--attention-dropout 0", 2),
    ("moe-ep-with-tp-without-sp", f"{MOE} {TP2} --expert-model-parallel-size 2", 4),
    ("moe-ep-with-tp-and-sp", f"{MOE} {TP2} --expert-model-parallel-size 2 --sequence-parallel",
     4),
    ("moe-router-dtype-fp32", f"{MOE} --moe-router-dtype fp32", 1),
    ("moe-token-drop-with-alltoall", f"{MOE} --moe-token-dispatcher-type alltoall "
     "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity", 1),
    ("moe-grouped-gemm", f"{MOE} --moe-grouped-gemm", 1),
    ("moe-shared-expert-overlap-with-allgather", f"{MOE} --moe-shared-expert-intermediate-size "
     "32 --moe-shared-expert-overlap --moe-token-dispatcher-type allgather", 1),
    ("ffn-size-from-swiglu", "--swiglu", 1),
    ("bf16-with-grad-reduce-in-bf16", "--bf16 --grad-reduce-in-bf16", 1),
    ("precision-aware-bf16-moments", "--bf16 --use-precision-aware-optimizer "
     "--use-distributed-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16", 2),
    ("precision-aware-without-distopt", "--bf16 --use-precision-aware-optimizer", 1),
    # --- accepted lines whose derived settings are compared
    ("moe-layer-recompute", f"{MOE} --moe-layer-recompute", 1),
    ("recompute-activations", "--recompute-activations", 1),
    ("bf16", "--bf16", 1),
    ("group-query-attention-without-groups", "--group-query-attention", 1),
    ("rmsnorm-with-norm-epsilon", "--normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm",
     1),
    ("no-position-embedding-with-rope", "--position-embedding-type rope "
     "--no-position-embedding", 1),
    ("sample-based-schedule", "--train-samples 100 --lr-decay-samples 50 "
     "--lr-warmup-samples 10", 1),
    ("vpp-stages-per-rank", f"{PP2} --num-virtual-stages-per-pipeline-rank 2 "
     "--global-batch-size 4", 2),
    ("layout-with-virtual-stages", f"{PP2} --pipeline-model-parallel-layout Et|tt|t|tL "
     "--global-batch-size 4", 2),
    ("data-parallel-accumulation", "--global-batch-size 8", 4),
    ("disable-bias-linear", "--disable-bias-linear --swiglu --untie-embeddings-and-output-weights",
     1),
    ("moe-alltoall-top1", f"{MOE} --moe-token-dispatcher-type alltoall --moe-router-topk 1 "
     "--moe-router-pre-softmax --moe-aux-loss-coeff 0.01", 1),
    ("fp16-dynamic-loss-scale", "--fp16", 1),
    ("fp16-static-loss-scale", "--fp16 --loss-scale 1024", 1),
    ("skip-train", "--skip-train", 1),
    ("finetune-without-optimizer-state", "--finetune --no-load-optim --no-load-rng", 1),
    ("wsd-schedule", "--lr-decay-style WSD --lr-wsd-decay-style cosine "
     "--lr-wsd-decay-iters 5", 1),
    ("weight-decay-linear", "--start-weight-decay 0 --end-weight-decay 0.1 "
     "--weight-decay-incr-style linear", 1),
    ("decoupled-lr", "--decoupled-lr 2e-3 --decoupled-min-lr 1e-4", 1),
    ("sgd", "--optimizer sgd --sgd-momentum 0.8", 1),
    ("manual-gc", "--manual-gc --manual-gc-interval 5", 1),
    ("eval-batches", "--eval-global-batch-size 4 --eval-micro-batch-size 2 --eval-iters 3 "
     "--eval-interval 5", 2),
    ("warmup-fraction", "--lr-warmup-fraction 0.1 --lr-warmup-init 1e-5", 1),
    ("packed-documents", "--reset-position-ids --reset-attention-mask --eod-mask-loss", 1),
    ("split-and-seed", "--split 90,5,5 --seed 7 --make-vocab-size-divisible-by 64", 1),
    ("check-weight-hash-under-zero3", f"{FSDP} --ckpt-format fsdp_dtensor "
     "--check-weight-hash-across-dp-replicas-interval 10", 2),
]  # fmt: skip


def command_line(flags: str) -> list[str]:
    """BASE, then TRAINING and DATA where the case has none of its own, then the case's."""
    words = flags.split()
    if "--train-iters" not in words and "--train-samples" not in words:
        words = [*TRAINING.split(), *words]
    if not any(flag in words for flag in DATA_FLAGS):
        words = [*DATA.split(), *words]
    return [*BASE.split(), *words]
