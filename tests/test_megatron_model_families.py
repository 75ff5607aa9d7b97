"""The model families of Megatron-LM's examples/post_training/modelopt/conf/ through
apps/gpt's pretrain_gpt.py: each family's MODEL_ARGS, copied as Megatron-LM writes them
(FAMILIES names the file), with the width shrunk (SHRINK) and a mock-data run's flags
added, trains 3 iterations on one CPU rank with a finite loss: every model line of the
folder, 24 (Mamba-hybrid lines with their pattern shrunk to each kind of layer once;
moonshotai/kimi_k2_instruct*.sh only set a layout for Kimi-K2-Instruct.sh's model, and
NVIDIA-Nemotron-Nano-9B-v2-Base.sh links to the 9B-v2 line), and Megatron-LM's gated
DeltaNet line (Qwen3-Next's layers), which the folder does not have yet, from its
functional tests (a DeltaNet and a softmax layer at the shrunk depth).

Every flag of these lines is honoured, accepted without effect (megatron_flags.IGNORED,
with the reason in --help) or refused (megatron_flags.REFUSED): none is dropped silently.
The lines keep their --bf16 (as cheap as fp32 at this width on a CPU); the runs leave
out the compiled fused loss (COMPILED).
"""

import math

import pytest

from mp_gpt.testing import GIVEN_PEAK, metrics_records, train_on_rank
from mp_state.testing import run_on_ranks
from mp_train import build_parser

pytestmark = pytest.mark.multirank

MEGATRON_CONF = "Megatron-LM examples/post_training/modelopt/conf/"

# family -> (its file under MEGATRON_CONF, its MODEL_ARGS as written there)
FAMILIES = {
    "Llama-3.1-8B": (
        "meta-llama/Llama-3.1-8B-Instruct.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights
    --use-rotary-position-embeddings --rotary-percent 1.0 --no-rope-fusion
    --no-position-embedding --normalization RMSNorm --swiglu --num-layers 32
    --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --seq-length 4096
    --max-position-embeddings 8192 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1 --use-mcore-models --rotary-base 500000
    --use-rope-scaling
""",
    ),
    "Llama-3.2-1B": (
        "meta-llama/Llama-3.2-1B-Instruct.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --use-rotary-position-embeddings --no-rope-fusion
    --no-position-embedding --normalization RMSNorm --swiglu --num-layers 16
    --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --seq-length 4096
    --max-position-embeddings 8192 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1 --use-mcore-models --rotary-percent 1.0
    --rotary-base 500000 --use-rope-scaling
""",
    ),
    "Qwen2.5-0.5B": (
        "Qwen/Qwen2.5-0.5B-Instruct.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --add-qkv-bias --position-embedding-type rope --no-rope-fusion
    --normalization RMSNorm --swiglu --num-layers 24 --hidden-size 896
    --ffn-hidden-size 4864 --num-attention-heads 14 --group-query-attention
    --num-query-groups 2 --kv-channels 64 --seq-length 4096
    --max-position-embeddings 32768 --tokenizer-type HuggingFaceTokenizer
    --padded-vocab-size 151936 --make-vocab-size-divisible-by 1 --use-mcore-models
    --rotary-percent 1.0 --rotary-base 1000000 --no-bias-swiglu-fusion
""",
    ),
    "Qwen2.5-7B": (
        "Qwen/Qwen2.5-7B-Instruct.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --add-qkv-bias --position-embedding-type rope --no-rope-fusion
    --normalization RMSNorm --swiglu --num-layers 28 --hidden-size 3584
    --ffn-hidden-size 18944 --num-attention-heads 28 --group-query-attention
    --num-query-groups 4 --kv-channels 128 --seq-length 4096
    --max-position-embeddings 32768 --tokenizer-type HuggingFaceTokenizer
    --padded-vocab-size 152064 --make-vocab-size-divisible-by 1 --use-mcore-models
    --rotary-percent 1.0 --rotary-base 1000000 --no-bias-swiglu-fusion
    --untie-embeddings-and-output-weights
""",
    ),
    "Qwen3-0.6B": (
        "Qwen/Qwen3-0.6B.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --position-embedding-type rope --no-rope-fusion
    --normalization RMSNorm --swiglu --num-layers 28 --hidden-size 1024
    --ffn-hidden-size 3072 --num-attention-heads 16 --group-query-attention
    --num-query-groups 8 --kv-channels 128 --qk-layernorm --seq-length 4096
    --max-position-embeddings 40960 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0
    --rotary-base 1000000 --no-bias-swiglu-fusion
""",
    ),
    "Qwen3-8B": (
        "Qwen/Qwen3-8B.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu
    --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 40960
    --tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 1187
    --use-mcore-models --rotary-percent 1.0 --rotary-base 1000000 --no-bias-swiglu-fusion
""",
    ),
    "Qwen3-30B-A3B": (
        "Qwen/Qwen3-30B-A3B.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu
    --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32
    --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
    --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8
    --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss --seq-length 4096
    --max-position-embeddings 40960 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0
    --rotary-base 1000000 --no-bias-swiglu-fusion --sequence-parallel
""",
    ),
    "Qwen3-235B-A22B": (
        "Qwen/Qwen3-235B-A22B.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu
    --num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 64
    --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
    --num-experts 128 --moe-ffn-hidden-size 1536 --moe-router-topk 8
    --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss --moe-layer-recompute --seq-length 4096
    --max-position-embeddings 40960 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0
    --rotary-base 1000000 --rotary-seq-len-interpolation-factor 1 --no-bias-swiglu-fusion
    --attention-dropout 0.0 --hidden-dropout 0.0 --sequence-parallel
""",
    ),
    "Nemotron-Mini-4B": (
        "nvidia/Nemotron-Mini-4B-Instruct.sh",
        """
    --trust-remote-code --save-interval 100000 --micro-batch-size 1 --bf16
    --no-masked-softmax-fusion --disable-bias-linear --untie-embeddings-and-output-weights
    --use-rotary-position-embeddings --rotary-percent 0.5 --no-rope-fusion
    --no-position-embedding --normalization LayerNorm --apply-layernorm-1p --squared-relu
    --num-layers 32 --hidden-size 3072 --ffn-hidden-size 9216 --num-attention-heads 24
    --group-query-attention --num-query-groups 8 --seq-length 4096
    --max-position-embeddings 4096 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1 --use-mcore-models --rotary-base 10000
""",
    ),
    "gpt-oss-20b": (
        "openai/gpt-oss-20b.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm
    --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --kv-channels 64 --num-experts 32
    --moe-ffn-hidden-size 2880 --moe-router-dtype fp32 --moe-router-topk 4
    --moe-aux-loss-coeff 0.0 --moe-token-dispatcher-type alltoall
    --moe-router-score-function softmax --moe-router-load-balancing-type aux_loss
    --seq-length 4096 --max-position-embeddings 40960
    --tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 128
    --use-mcore-models --rotary-percent 1.0 --rotary-base 150000 --no-bias-gelu-fusion
    --sequence-parallel --export-force-local-attention --no-bias-dropout-fusion
    --padded-vocab-size 201088 --quick-geglu --glu-linear-offset 1.0
    --softmax-type learnable --window-attn-skip-freq 2 --enable-gpt-oss
    --activation-func-clamp-value 7.0 --window-size 127,0
""",
    ),
    "gpt-oss-120b": (
        "openai/gpt-oss-120b.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm
    --num-layers 36 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --kv-channels 64 --num-experts 128
    --moe-ffn-hidden-size 2880 --moe-router-dtype fp32 --moe-router-topk 4
    --moe-aux-loss-coeff 0.0 --moe-token-dispatcher-type alltoall
    --moe-router-score-function softmax --moe-router-load-balancing-type aux_loss
    --seq-length 4096 --max-position-embeddings 40960
    --tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 128
    --use-mcore-models --rotary-percent 1.0 --rotary-base 150000 --no-bias-gelu-fusion
    --sequence-parallel --export-force-local-attention --no-bias-dropout-fusion
    --padded-vocab-size 201088 --quick-geglu --glu-linear-offset 1.0
    --softmax-type learnable --window-attn-skip-freq 2 --enable-gpt-oss
    --activation-func-clamp-value 7.0 --window-size 127,0
""",
    ),
    "Llama-4-Scout": (
        "meta-llama/Llama-4-Scout-17B-16E-Instruct.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu
    --num-layers 48 --hidden-size 5120 --ffn-hidden-size 16384 --num-attention-heads 40
    --group-query-attention --num-query-groups 8 --qk-layernorm --num-experts 16
    --moe-ffn-hidden-size 8192 --moe-router-score-function sigmoid --moe-router-topk 1
    --moe-router-topk-scaling-factor 1.0 --moe-router-dtype fp32
    --moe-shared-expert-intermediate-size 8192 --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs
    --moe-router-load-balancing-type seq_aux_loss --seq-length 4096
    --max-position-embeddings 4096 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 128 --use-mcore-models --rotary-interleaved
    --rotary-percent 1.0 --rotary-base 500000 --rope-scaling-factor 8.0 --use-rope-scaling
    --sequence-parallel --no-bias-swiglu-fusion --export-qk-l2-norm
    --export-moe-apply-probs-on-input --padded-vocab-size 202048
""",
    ),
    "Llama-4-Maverick": (
        "meta-llama/Llama-4-Maverick-17B-128E-Instruct.sh",
        """
    --recompute-activations --save-interval 100000 --micro-batch-size 1 --bf16
    --no-masked-softmax-fusion --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu
    --num-layers 48 --hidden-size 5120 --ffn-hidden-size 16384 --num-attention-heads 40
    --group-query-attention --num-query-groups 8 --num-experts 128
    --moe-layer-freq ([0,1]*24) --moe-layer-recompute --moe-ffn-hidden-size 8192
    --moe-router-score-function sigmoid --moe-router-topk 1
    --moe-router-topk-scaling-factor 1.0 --moe-router-dtype fp32
    --moe-shared-expert-intermediate-size 8192 --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs
    --moe-router-load-balancing-type seq_aux_loss --seq-length 2048
    --max-position-embeddings 2048 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1 --use-mcore-models --rotary-percent 1.0
    --rope-scaling-factor 8.0 --rotary-base 500000 --rotary-interleaved --no-rope-freq 4
    --export-moe-apply-probs-on-input --padded-vocab-size 202048
""",
    ),
    "DeepSeek-V2-Lite": (
        "deepseek-ai/DeepSeek-V2-Lite.sh",
        """
    --save-interval 100000 --attention-dropout 0.0 --hidden-dropout 0.0
    --micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear
    --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --num-layers 27
    --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16 --kv-channels 16
    --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 --qk-head-dim 128
    --qk-layernorm --qk-pos-emb-head-dim 64 --num-experts 64 --moe-layer-freq ([0]+[1]*26)
    --moe-ffn-hidden-size 1408 --moe-grouped-gemm --moe-router-score-function softmax
    --moe-router-topk 6 --moe-router-topk-scaling-factor 1.0 --moe-router-pre-softmax
    --moe-shared-expert-intermediate-size 2816 --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs
    --moe-router-load-balancing-type seq_aux_loss --seq-length 1024
    --max-position-embeddings 1024 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 3200 --attention-softmax-in-fp32 --use-mcore-models
    --rotary-percent 1.0 --rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707
    --mscale-all-dim 0.707 --sequence-parallel
""",
    ),
    "DeepSeek-R1": (
        "deepseek-ai/DeepSeek-R1.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
    --kv-channels 128 --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128
    --q-lora-rank 1536 --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64
    --num-experts 256 --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048
    --moe-router-dtype fp32 --moe-router-score-function sigmoid
    --moe-router-bias-update-rate 1e-3 --moe-router-enable-expert-bias --moe-router-topk 8
    --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-pre-softmax
    --moe-router-topk-scaling-factor 2.5 --moe-shared-expert-overlap
    --moe-shared-expert-intermediate-size 2048 --moe-aux-loss-coeff 1e-4
    --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
    --moe-token-drop-policy probs --seq-length 4096 --max-position-embeddings 163840
    --tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 1280
    --use-mcore-models --rotary-base 10000 --rotary-percent 1.0 --rotary-scaling-factor 40
    --mscale 1.0 --mscale-all-dim 1.0 --recompute-activations --moe-layer-recompute
    --sequence-parallel
""",
    ),
    "Kimi-K2": (
        "moonshotai/Kimi-K2-Instruct.sh",
        """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 64
    --kv-channels 128 --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128
    --q-lora-rank 1536 --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64
    --num-experts 384 --moe-layer-freq [0]*1+[1]*60 --moe-ffn-hidden-size 2048
    --moe-router-dtype fp32 --moe-router-score-function sigmoid
    --moe-router-bias-update-rate 1e-3 --moe-router-enable-expert-bias --moe-router-topk 8
    --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.827
    --moe-shared-expert-overlap --moe-shared-expert-intermediate-size 2048
    --moe-aux-loss-coeff 1e-4 --moe-router-load-balancing-type seq_aux_loss
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs --seq-length 4096
    --max-position-embeddings 131072 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1 --use-mcore-models --rotary-base 50000
    --rotary-percent 1.0 --rotary-scaling-factor 32 --mscale 1.0 --mscale-all-dim 1.0
    --padded-vocab-size 163840 --recompute-activations --moe-layer-recompute
    --sequence-parallel --trust-remote-code
""",
    ),
    "Nemotron-H-8B": (
        "nvidia/Nemotron-H-8B-Base-8K.sh",
        """
    --trust-remote-code --save-interval 100000 --micro-batch-size 1 --bf16
    --no-masked-softmax-fusion --disable-bias-linear --untie-embeddings-and-output-weights
    --use-rotary-position-embeddings --no-rope-fusion --no-position-embedding
    --normalization RMSNorm --squared-relu --hidden-size 4096 --ffn-hidden-size 21504
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --hybrid-layer-pattern M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-
    --mamba-head-dim 64 --mamba-num-heads 128 --mamba-num-groups 8 --mamba-state-dim 128
    --seq-length 4096 --max-position-embeddings 8192 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1 --use-mcore-models --rotary-percent 0.5
    --rotary-base 500000 --export-model-type HybridModel
""",
    ),
    "Nemotron-Nano-9B-v2": (
        "nvidia/NVIDIA-Nemotron-Nano-9B-v2.sh",
        """
    --trust-remote-code --save-interval 100000 --micro-batch-size 1 --bf16
    --no-masked-softmax-fusion --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type none --no-rope-fusion --normalization RMSNorm --squared-relu
    --hidden-size 4480 --ffn-hidden-size 15680 --num-attention-heads 40 --kv-channels 128
    --group-query-attention --num-query-groups 8
    --hybrid-layer-pattern M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-
    --mamba-head-dim 80 --mamba-num-heads 128 --mamba-num-groups 8 --mamba-state-dim 128
    --seq-length 4096 --max-position-embeddings 131072
    --tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 1
    --use-mcore-models --export-model-type HybridModel --padded-vocab-size 131072
""",
    ),
    "Nemotron-3-Nano-30B": (
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.sh",
        """
    --trust-remote-code --save-interval 100000 --micro-batch-size 1
    --moe-token-dispatcher-type alltoall --enable-experimental --moe-permute-fusion
    --use-fused-weighted-squared-relu --cross-entropy-loss-fusion
    --cross-entropy-fusion-impl native --moe-router-score-function sigmoid
    --moe-grouped-gemm --num-experts 128 --moe-router-topk 6 --moe-aux-loss-coeff 1e-4
    --moe-router-topk-scaling-factor 2.5 --moe-router-enable-expert-bias
    --moe-router-dtype fp32 --moe-router-load-balancing-type seq_aux_loss
    --moe-shared-expert-intermediate-size 3712 --attention-backend flash
    --disable-gloo-process-groups --mamba-num-heads 64 --mamba-head-dim 64
    --hybrid-layer-pattern MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME
    --use-mcore-models --untie-embeddings-and-output-weights --disable-bias-linear
    --init-method-std 0.0173 --position-embedding-type none --squared-relu
    --hidden-size 2688 --num-attention-heads 32 --group-query-attention
    --num-query-groups 2 --ffn-hidden-size 1856 --kv-channels 128 --normalization RMSNorm
    --tokenizer-type HuggingFaceTokenizer --bf16 --seq-length 8192
    --max-position-embeddings 8192 --export-model-type HybridModel
""",
    ),
    "Nemotron-H-4B": (
        "nvidia/Nemotron-H-4B-Instruct.sh",
        """
    --trust-remote-code --save-interval 100000 --micro-batch-size 1 --bf16
    --no-masked-softmax-fusion --disable-bias-linear
    --untie-embeddings-and-output-weights --use-rotary-position-embeddings
    --rotary-percent 0.5 --no-rope-fusion --no-position-embedding --normalization
    RMSNorm --squared-relu --hidden-size 3072 --ffn-hidden-size 12288 --kv-channels 128
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --hybrid-layer-pattern M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-
    --mamba-head-dim 64 --mamba-num-heads 112 --mamba-num-groups 8 --mamba-state-dim 128
    --seq-length 4096 --max-position-embeddings 8192 --tokenizer-type
    HuggingFaceTokenizer --make-vocab-size-divisible-by 1 --use-mcore-models
    --rotary-base 10000 --export-model-type HybridModel
""",
    ),
    "Nemotron-H-47B": (
        "nvidia/Nemotron-H-47B-Reasoning-128K.sh",
        """
    --trust-remote-code --save-interval 100000 --micro-batch-size 1 --bf16
    --attention-backend flash --disable-bias-linear
    --untie-embeddings-and-output-weights --position-embedding-type none --normalization
    RMSNorm --squared-relu --hidden-size 8192 --ffn-hidden-size 30720
    --num-attention-heads 64 --kv-channels 128 --group-query-attention
    --num-query-groups 8 --hybrid-layer-pattern
    M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---M-M*-M-M-M-M-M-
    --mamba-head-dim 64 --mamba-num-heads 256 --mamba-num-groups 8 --mamba-state-dim 256
    --seq-length 8192 --max-position-embeddings 8192 --tokenizer-type
    HuggingFaceTokenizer --use-mcore-models --export-model-type HybridModel
""",
    ),
    "Nemotron-H-56B": (
        "nvidia/Nemotron-H-56B-Base-8K.sh",
        """
    --trust-remote-code --save-interval 100000 --micro-batch-size 1 --attention-backend
    flash --hybrid-layer-pattern
    M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-
    --mamba-state-dim 256 --tiktoken-pattern v2 --use-mcore-models
    --untie-embeddings-and-output-weights --disable-bias-linear --init-method-std 0.0099
    --position-embedding-type none --squared-relu --hidden-size 8192
    --num-attention-heads 64 --group-query-attention --num-query-groups 8
    --ffn-hidden-size 32768 --kv-channels 128 --normalization RMSNorm
    --exit-duration-in-mins 230 --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 1 --seq-length 8192 --max-position-embeddings 8192
    --tokenizer-type HuggingFaceTokenizer --bf16 --export-model-type HybridModel
""",
    ),
    "Nemotron-3-Super-120B": (
        "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16.sh",
        """
    --trust-remote-code --save-interval 100000 --micro-batch-size 1
    --enable-experimental --use-fused-weighted-squared-relu --cross-entropy-loss-fusion
    --cross-entropy-fusion-impl native --num-experts 512 --moe-router-score-function
    sigmoid --moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-topk 22
    --moe-permute-fusion --moe-router-topk-scaling-factor 5.0
    --moe-router-enable-expert-bias --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-shared-expert-intermediate-size
    5376 --moe-token-dispatcher-type alltoall --moe-latent-size 1024 --attention-backend
    flash --disable-gloo-process-groups --is-hybrid-model --mamba-num-heads 128
    --mamba-head-dim 64 --hybrid-layer-pattern
    MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME
    --use-mcore-models --untie-embeddings-and-output-weights --disable-bias-linear
    --init-method-std 0.014 --position-embedding-type none --squared-relu --hidden-size
    4096 --num-attention-heads 32 --group-query-attention --num-query-groups 2
    --ffn-hidden-size 2688 --kv-channels 128 --normalization RMSNorm --attention-dropout
    0.0 --hidden-dropout 0.0 --tokenizer-type HuggingFaceTokenizer --bf16 --seq-length
    8192 --max-position-embeddings 8192 --export-model-type HybridModel
""",
    ),
    "Nemotron-3-Ultra-550B": (
        "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16.sh",
        """
    --trust-remote-code --save-interval 100 --micro-batch-size 1 --enable-experimental
    --use-fused-weighted-squared-relu --cross-entropy-loss-fusion
    --cross-entropy-fusion-impl native --moe-permute-fusion --moe-latent-size 2048
    --moe-router-score-function sigmoid --moe-grouped-gemm --num-experts 512
    --moe-router-topk 22 --moe-shared-expert-intermediate-size 10240
    --moe-aux-loss-coeff 1e-4 --moe-router-topk-scaling-factor 5.0
    --moe-router-enable-expert-bias --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
    --attention-backend flash --disable-gloo-process-groups --is-hybrid-model
    --mamba-num-heads 256 --mamba-head-dim 64 --hybrid-override-pattern
    MEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME
    --use-mcore-models --untie-embeddings-and-output-weights --disable-bias-linear
    --init-method-std 0.0099 --position-embedding-type none --squared-relu --num-layers
    108 --hidden-size 8192 --num-attention-heads 64 --group-query-attention
    --num-query-groups 2 --ffn-hidden-size 5120 --kv-channels 128 --normalization
    RMSNorm --tokenizer-type HuggingFaceTokenizer --bf16 --seq-length 8192
    --max-position-embeddings 8192 --export-model-type HybridModel
""",
    ),
    # Megatron-LM's own gated DeltaNet line (Qwen3-Next's layers): its functional test's
    # MODEL_ARGS, tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp1_gdn/
    # model_config.yaml, without its data, logging and checkpoint paths
    "Qwen3-Next-GDN": (
        "../../../../tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp1_gdn/"
        "model_config.yaml",
        """
    --untie-embeddings-and-output-weights --num-layers 6 --hidden-size 512
    --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu
    --position-embedding-type rope --rotary-percent 0.5 --no-rope-fusion --apply-layernorm-1p
    --apply-wd-to-qk-layernorm --attention-output-gate
    --experimental-attention-variant gated_delta_net --linear-attention-freq 3
    --linear-conv-kernel-dim 4 --linear-key-head-dim 64 --linear-value-head-dim 64
    --linear-num-key-heads 4 --linear-num-value-heads 8 --num-experts 32
    --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate
    --moe-router-load-balancing-type aux_loss --moe-router-topk 8 --disable-bias-linear
    --moe-router-dtype fp32 --micro-batch-size 4 --seq-length 1024
    --max-position-embeddings 1024 --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1 --sequence-parallel --deterministic-mode
    --no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models
    --ckpt-format torch_dist --bf16 --attention-backend unfused
""",
    ),
}

TRAINS = [
    "Llama-3.1-8B", "Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen2.5-7B", "Qwen3-0.6B", "Qwen3-8B",
    "Qwen3-30B-A3B", "Qwen3-235B-A22B", "Nemotron-Mini-4B", "gpt-oss-20b", "gpt-oss-120b",
    "DeepSeek-V2-Lite", "DeepSeek-R1", "Kimi-K2", "Llama-4-Scout", "Llama-4-Maverick",
    "Nemotron-H-8B", "Nemotron-Nano-9B-v2", "Nemotron-3-Nano-30B", "Nemotron-H-4B",
    "Nemotron-H-47B", "Nemotron-H-56B", "Nemotron-3-Super-120B", "Nemotron-3-Ultra-550B",
    "Qwen3-Next-GDN",
]  # fmt: skip
# The width shrunk to a few seconds per run: flag -> its value here.
SHRINK = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128",
    "--moe-ffn-hidden-size": "32", "--moe-shared-expert-intermediate-size": "32",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
    "--num-experts": "4", "--moe-router-topk": "2", "--seq-length": "32",
    "--max-position-embeddings": "64", "--padded-vocab-size": "1024", "--window-size": "8,0",
    "--tokenizer-type": "NullTokenizer", "--moe-layer-freq": "([0]+[1]*1)",
    "--q-lora-rank": "48", "--kv-lora-rank": "32", "--qk-head-dim": "16",
    "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16",
    "--moe-router-num-groups": "2", "--moe-router-group-topk": "1", "--no-rope-freq": "2",
    "--mamba-num-heads": "8", "--mamba-head-dim": "8", "--mamba-num-groups": "2",
    "--mamba-state-dim": "16", "--moe-latent-size": "16", "--tensor-model-parallel-size": "1",
    "--linear-attention-freq": "2", "--linear-key-head-dim": "16",
    "--linear-value-head-dim": "16", "--linear-num-key-heads": "2",
    "--linear-num-value-heads": "4", "--micro-batch-size": "1",
}  # fmt: skip
# The hybrid pattern flags (Megatron's name and its older one)
PATTERN = {"--hybrid-layer-pattern", "--hybrid-override-pattern"}
# Kept as given where smaller: Llama 4 routes each token to one expert (which
# --export-moe-apply-probs-on-input needs).
AT_MOST = {"--moe-router-topk"}


# Left out of the CPU runs (Nemotron 3 Nano's line has it): the fused loss is compiled by
# inductor at its first use, tens of seconds on a loaded CPU in a forked rank (and a
# cold compile cache's worker pool can outlast the run's timeout);
# tests/test_train_compiled_optimizer.py trains with it.
COMPILED = {"--cross-entropy-loss-fusion"}


def shrunk(family: str) -> list[str]:
    words = FAMILIES[family][1].split()
    out = []
    for i, word in enumerate(words):
        previous = words[i - 1] if i else ""
        if previous in PATTERN:  # each kind of layer once, in order
            word = "".join(dict.fromkeys(word))
        elif previous == "--num-layers" and any(w in PATTERN for w in words):
            pattern = words[next(j for j, w in enumerate(words) if w in PATTERN) + 1]
            word = str(len(dict.fromkeys(pattern)))  # the shrunk pattern's length
        elif previous in SHRINK and not word.startswith("--"):
            small = SHRINK[previous]
            word = str(min(int(word), int(small))) if previous in AT_MOST else small
        out.append(word)
    if any(w in PATTERN for w in words) and "--mamba-head-dim" not in words:
        # Megatron's default mixer width 2h in heads of 64: 2 heads at the shrunk h = 64,
        # fewer than the 8 groups; heads of 8 give 16
        out += ["--mamba-head-dim", "8"]
    return out


def run_options(run_dir) -> list[str]:
    return [
        "--mock-data", *GIVEN_PEAK,
        "--vocab-size", "1000", "--train-iters", "3", "--global-batch-size", "2",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-interval", "none", "--log-interval",
        "10", "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"), "--num-workers", "0",
    ]  # fmt: skip


@pytest.mark.parametrize("family", TRAINS)
def test_the_family_trains(tmp_path, family):
    line = [word for word in shrunk(family) if word not in COMPILED]
    run_on_ranks(train_on_rank, 1, [*line, *run_options(tmp_path)], timeout=120)
    records = metrics_records(tmp_path)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["lm loss"]) for r in records), records


def test_every_family_is_tested_and_every_flag_known():
    assert sorted(FAMILIES) == sorted(TRAINS)
    known = build_parser()._option_string_actions
    for family in TRAINS:
        unknown = [w for w in shrunk(family) if w.startswith("--") and w not in known]
        assert unknown == [], family
