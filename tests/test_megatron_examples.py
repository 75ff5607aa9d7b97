"""The training lines of Megatron-LM's own example scripts through apps/gpt's
pretrain_gpt.py: each script's flags, copied as Megatron-LM writes them (EXAMPLES names
the file; its shell variables filled in with the script's values; its mock-data branch,
or mock data for its data arguments (MOCK_DATA); without torchrun's options and the
output paths), with the model shrunk (SHRINK) and the run cut to 3 iterations on one CPU
rank.

As written, a line that holds a flag mp refuses stops before starting with one error
line naming the first such flag; without the flags mp refuses (DROP), it trains with a
finite loss. Every flag of these lines is known to mp's parser.
"""

import math
import re

import pytest

from mp_gpt.testing import GIVEN_PEAK, metrics_records, train_on_rank
from mp_state.testing import run_on_ranks
from mp_train import build_parser

pytestmark = pytest.mark.multirank

MEGATRON_EXAMPLES = "Megatron-LM examples/"

# example -> (its file under MEGATRON_EXAMPLES, its pretrain_gpt.py flags as written there)
EXAMPLES = {
    "Llama-3-8B, FP8": (
        "llama/train_llama3_8b_h100_fp8.sh",
        """
    --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
    --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
    --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
    --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
    --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
    --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
    --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
    --fp8-param-gather
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --tiktoken-pattern v2
    --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
    --num-workers 1
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000
    --log-throughput --profile --profile-step-start 4 --profile-step-end 6
    --ckpt-format torch_dist --distributed-timeout-minutes 60
""",
    ),
    "Mixtral-8x7B": (
        "mixtral/train_mixtral_8x7b_distributed.sh",
        """
    --use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0
    --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8
    --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --overlap-param-gather --overlap-grad-reduce
    --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
    --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
    --lr-warmup-iters 500 --clip-grad 1.0 --bf16
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --no-load-optim --no-load-rng
""",
    ),
    "gpt-oss": (
        "gptoss/02_train.sh",
        """
    --no-masked-softmax-fusion --transformer-impl transformer_engine --disable-bias-linear
    --untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm
    --num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --seq-length 8192
    --max-position-embeddings 8192 --use-mcore-models --rotary-percent 1.0 --rope-type rope
    --position-embedding-type rope --rotary-base 10000 --no-bias-gelu-fusion
    --export-force-local-attention --no-bias-dropout-fusion --quick-geglu
    --glu-linear-offset 1.0 --softmax-type learnable --window-attn-skip-freq 2
    --activation-func-clamp-value 7.0 --window-size 127,0 --enable-gpt-oss
    --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --overlap-param-gather --overlap-grad-reduce --moe-ffn-hidden-size 2048
    --moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 --moe-permute-fusion
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --tiktoken-pattern v2
    --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
    --num-workers 1
    --micro-batch-size 1 --global-batch-size 128 --lr 1.0e-5 --train-samples 1953125000
    --lr-decay-samples 1949218748 --lr-decay-style cosine --min-lr 1.0e-6
    --weight-decay 0.1 --lr-warmup-fraction 0.05 --clip-grad 1.0 --bf16 --use-flash-attn
    --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32
    --disable-bf16-reduced-precision-matmul --recompute-activations
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 8
    --expert-model-parallel-size 1 --sequence-parallel --context-parallel-size 1
    --use-distributed-optimizer --fp8-format hybrid --fp8-param-gather
    --fp8-amax-compute-algo max --fp8-amax-history-len 1024
    --log-interval 1 --save-interval 10000 --eval-interval 50000000 --eval-iters 0
    --moe-per-layer-logging --no-load-optim --no-load-rng --log-throughput
""",
    ),
    "DeepSeek-V3, Megatron-FSDP": (
        "megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
        """
    --distributed-timeout-minutes 60 --tensor-model-parallel-size 1
    --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --context-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear
    --micro-batch-size 4 --global-batch-size 2048 --train-samples 585937500
    --exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad --manual-gc
    --manual-gc-interval 10 --recompute-granularity selective
    --recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine
    --seq-length 4096 --no-mmap-bin-files --no-create-attention-mask-in-dataloader
    --num-workers 6 --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432
    --num-attention-heads 128 --kv-channels 128 --max-position-embeddings 4096
    --position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 3232
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
    --multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0
    --weight-decay 0.1 --qk-layernorm --lr-decay-samples 584765624
    --lr-warmup-samples 1536000 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7
    --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 256
    --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss
    --moe-router-topk 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep
    --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
    --moe-router-group-topk 4 --moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
    --moe-router-force-load-balancing --q-lora-rank 1536 --kv-lora-rank 512
    --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40
    --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --eval-iters 32 --eval-interval 100 --auto-detect-ckpt-format --save-interval 100
    --dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard
    --log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
    --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40
    --bf16 --enable-experimental
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
    --no-gradient-accumulation-fusion --use-distributed-optimizer --calculate-per-token-loss
    --init-model-with-meta-device --ckpt-format fsdp_dtensor --fsdp-double-buffer
    --use-nccl-ub --megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16
    --wandb-project your_own_wandb_project --wandb-exp-name DeepSeek-V3-TP1EP8-MBS4GBS2048-
""",
    ),
}

# example -> the flags mp refuses in its line, each with what it takes (the first given in
# REFUSED's order is the one named): the line trains without them.
DROP = {
    "Llama-3-8B, FP8": {"--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": 1,
                        "--fp8-param-gather": 0},
    "Mixtral-8x7B": {},
    "gpt-oss": {"--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": 1,
                "--fp8-param-gather": 0},
    "DeepSeek-V3, Megatron-FSDP": {"--moe-flex-dispatcher-backend": 1,
                                   "--moe-token-dispatcher-type": 1},
}  # fmt: skip
# example -> the refused flag its line as written is stopped at (REFUSED's order)
FIRST_REFUSED = {"Llama-3-8B, FP8": "--fp8-amax-history-len", "gpt-oss": "--fp8-amax-history-len",
                 "DeepSeek-V3, Megatron-FSDP": "--moe-flex-dispatcher-backend"}  # fmt: skip

# example -> what stands for its data arguments where the script has no mock-data branch
MOCK_DATA = {
    "Mixtral-8x7B": ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                     "--num-workers", "0"],
    "DeepSeek-V3, Megatron-FSDP": ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                   "--vocab-size", "1000"],
}  # fmt: skip

# What a CPU cannot run, refused on this machine only: FP8 (no FP8 tensor cores) and
# Transformer Engine's layers (CUDA); the lines train in bf16 with mp's own layers here.
CPU_REFUSES = {"--fp8-format": 1, "--transformer-impl": 1}

# Left out of the CPU runs for time: the fused loss is compiled by inductor at its first
# use (tens of seconds on a loaded CPU, in a forked rank); tests/test_train_compiled_optimizer.py
# trains with it.
COMPILED = {"--cross-entropy-loss-fusion": 0}

SHRINK = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128",
    "--moe-ffn-hidden-size": "32", "--num-attention-heads": "4", "--num-query-groups": "2",
    "--kv-channels": "16", "--num-experts": "4", "--seq-length": "32",
    "--max-position-embeddings": "64", "--vocab-size": "1000", "--window-size": "8,0",
    "--global-batch-size": "2", "--train-samples": "6", "--lr-decay-samples": "6",
    "--lr-warmup-samples": "2", "--train-iters": "3", "--lr-decay-iters": "3",
    "--lr-warmup-iters": "1", "--pipeline-model-parallel-size": "1",
    "--expert-model-parallel-size": "1", "--eval-iters": "1", "--num-workers": "0",
    "--micro-batch-size": "1", "--moe-layer-freq": "([0]+[1]*1)", "--moe-router-topk": "2",
    "--moe-shared-expert-intermediate-size": "32", "--moe-router-num-groups": "2",
    "--moe-router-group-topk": "1", "--q-lora-rank": "48", "--kv-lora-rank": "32",
    "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16",
}  # fmt: skip


def shrunk(example: str, without: dict[str, int] | None = None) -> list[str]:
    words, out, skip = EXAMPLES[example][1].split(), [], 0
    for i, word in enumerate(words):
        if skip:
            skip -= 1
            continue
        if without and word in without:
            skip = without[word]
            continue
        previous = words[i - 1] if i else ""
        out.append(SHRINK[previous] if previous in SHRINK and not word.startswith("--") else word)
    return out


def run_options(run_dir) -> list[str]:
    return [
        *GIVEN_PEAK, "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"),
        "--tensorboard-dir", str(run_dir / "tb"), "--data-cache-path", str(run_dir / "cache"),
        "--metrics-file", str(run_dir / "metrics.jsonl"),
    ]  # fmt: skip


@pytest.mark.parametrize("example", [e for e in EXAMPLES if DROP[e]])
def test_the_line_as_written_names_the_first_flag_mp_refuses(tmp_path, capsys, example):
    from mp_gpt.pretrain import main

    assert main([*shrunk(example), *run_options(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # notes on accepted flags may come first
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    assert errors[0].startswith(f"error: {FIRST_REFUSED[example]}: "), errors[0]


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_the_line_trains_without_the_flags_mp_refuses(tmp_path, example):
    argv = [*shrunk(example, DROP[example] | CPU_REFUSES | COMPILED), *MOCK_DATA.get(example, []),
            *run_options(tmp_path)]  # fmt: skip
    assert run_on_ranks(train_on_rank, 1, argv, timeout=120) == [0]
    records = metrics_records(tmp_path)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["lm loss"]) for r in records), records


def test_every_flag_is_known():
    known = build_parser()._option_string_actions
    for example, (_, line) in EXAMPLES.items():
        flags = re.findall(r"(?<!\S)--[a-z][a-z0-9-]*", line)
        assert [f for f in flags if f not in known] == [], example
