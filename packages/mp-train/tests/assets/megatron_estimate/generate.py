"""Writes cases.json: what megatron-core 0.19.2 reports for a set of Megatron-LM command
lines, the reference of test_estimate_megatron.py (which reads the JSON and needs no
Megatron). Run with megatron-core 0.19.2 installed (Python >= 3.12; it runs on a CPU):

    python generate.py            # -> cases.json beside this file

Each case is a command line as pretrain_gpt.py takes it (a model's flags, then the
layout's, written with the short names of SHORT), a world size and the tokenizer's
vocabulary. Megatron's own parse_args and validate_args turn it into its
args (the world size from WORLD_SIZE, as torchrun gives it), vocab_size_with_padding
pads the vocabulary, and the case records:

- report: the lines report_theoretical_memory(args, num_microbatches, verbose=True)
  prints (Megatron prints them after the first iteration, num_microbatches being
  global batch / (micro batch x data parallel));
- weight_and_optimizer_mb, activation_mb, total_mb: what that call returns;
- flops_per_iteration: num_floating_point_operations(args, global_batch_size).

validate_args asks the GPU's compute capability once (for a Blackwell-only rule): a stub
answers 9 (Hopper). Nothing else is patched.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import types
from pathlib import Path

import torch

torch.cuda.get_device_properties = lambda *_, **__: types.SimpleNamespace(major=9, minor=0)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args' rule for TP > 1

from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding  # noqa: E402
from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.theoretical_memory_usage import report_theoretical_memory  # noqa: E402
from megatron.training.training import num_floating_point_operations  # noqa: E402

GPT2_1B3 = (
    "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048"
)
LLAMA_8B = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
    "--disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--seq-length 8192 --max-position-embeddings 8192"
)
MIXTRAL = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
    "--untie-embeddings-and-output-weights --position-embedding-type rope "
    "--num-experts 8 --moe-router-topk 2 --seq-length 4096 --max-position-embeddings 4096"
)
DEEPSEEK_V3 = (
    "--num-layers 61 --hidden-size 7168 --num-attention-heads 128 --ffn-hidden-size "
    "18432 --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
    "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
    "--normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --position-embedding-type rope "
    "--num-experts 256 --moe-ffn-hidden-size 2048 --moe-router-topk 8 "
    "--moe-shared-expert-intermediate-size 2048 --moe-layer-freq ([0]*3+[1]*58) "
    "--seq-length 4096 --max-position-embeddings 4096"
)
V2_LITE = (
    "--num-layers 27 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 10944 "
    "--multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 "
    "--qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --normalization RMSNorm "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --num-experts 64 --moe-ffn-hidden-size 1408 "
    "--moe-router-topk 6 --moe-shared-expert-intermediate-size 2816 "
    "--moe-layer-freq ([0]+[1]*26) --seq-length 4096 --max-position-embeddings 4096"
)
# The tokenizers' vocabularies.
VOCAB = {GPT2_1B3: 50257, LLAMA_8B: 128256, MIXTRAL: 32000, DEEPSEEK_V3: 129280, V2_LITE: 102400}
# Short names for the flags of the cases below.
SHORT = {
    "mbs": "--micro-batch-size", "gbs": "--global-batch-size",
    "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
    "vpp-layers": "--num-layers-per-virtual-pipeline-stage", "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size",
    "sp": "--sequence-parallel", "selective": "--recompute-activations",
    "distopt": "--use-distributed-optimizer", "no-bias": "--disable-bias-linear",
    "rope": "--position-embedding-type rope", "mtp": "--mtp-num-layers",
    "full-uniform": "--recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers", "moe-freq": "--moe-layer-freq",
    "shared-gate": "--moe-shared-expert-gate",
    "first-stage": "--decoder-first-pipeline-num-layers",
    "last-stage": "--decoder-last-pipeline-num-layers",
}  # fmt: skip

# (name, model, world size, layout and other flags); every run is bf16.
CASES = [
    # The distributed optimizer over dp 4 at TP 2; no sequence parallelism: Megatron's
    # activations without SP. Then the same without biases and learned positions.
    ("gpt2-1.3b-tp2-dp4-distopt", GPT2_1B3, 8, "mbs 1 gbs 32 tp 2 distopt"),
    ("gpt2-1.3b-no-bias-tp2-dp4-distopt", GPT2_1B3, 8, "no-bias rope mbs 1 gbs 32 tp 2 distopt"),
    # One micro-batch per iteration for 2 stages (x min(1, m / p)); SP + selective.
    ("gpt2-1.3b-tp2-pp2-dp2-sp-selective", GPT2_1B3, 8, "mbs 1 gbs 2 tp 2 pp 2 sp selective"),
    # Context parallel 2 in the data-parallel count; Megatron's activations with SP.
    ("llama-8b-tp8-cp2-dp4-sp-selective-distopt", LLAMA_8B, 64, "mbs 1 gbs 64 tp 8 cp 2 sp "
     "selective distopt"),
    # The interleaved schedule's penalty, untied embeddings at p > 1.
    ("llama-8b-tp4-pp4-vpp2-sp-selective-distopt", LLAMA_8B, 32, "mbs 1 gbs 16 tp 4 pp 4 "
     "vpp-layers 4 sp selective distopt"),
    # 1F1B with m >= p; no SP (full recompute does not enter Megatron's formula).
    ("llama-8b-tp2-pp2-dp2-full-recompute", LLAMA_8B, 8, "mbs 2 gbs 16 tp 2 pp 2 full-uniform 1"),
    # A dense model with one multi-token prediction module.
    ("llama-8b-mtp1-tp2-dp4-distopt", LLAMA_8B, 8, "mtp 1 mbs 1 gbs 32 tp 2 distopt"),
    # Every other layer MoE (an integer moe_layer_freq), the interleaved schedule without SP.
    ("mixtral-freq2-pp2-vpp2-ep4", MIXTRAL, 8, "no-bias moe-freq 2 mbs 1 gbs 16 pp 2 "
     "vpp-layers 8 ep 4"),
    # docs/moe.md's layout: TP 2 + SP, PP 4, EP 8 over 64 ranks (expert dp 1).
    ("mixtral-tp2-pp4-ep8-sp-selective-distopt", MIXTRAL, 64, "no-bias mbs 1 gbs 64 tp 2 pp 4 "
     "ep 8 sp selective distopt"),
    # Biases on (the router's counted by Megatron), EP 4 over dp 8, no distributed optimizer.
    ("mixtral-bias-ep4-dp8", MIXTRAL, 8, "mbs 1 gbs 8 ep 4"),
    # The first 3 layers dense, one MTP module (a MoE layer, as the last), 61 layers over
    # 8 stages as 6 + 6 x 8 + 7, expert dp 2.
    ("deepseek-v3-tp2-pp8-ep64-mtp1-sp-selective-distopt", DEEPSEEK_V3, 1024, "mtp 1 mbs 1 "
     "gbs 1024 tp 2 pp 8 first-stage 6 last-stage 7 ep 64 etp 1 sp selective distopt"),
    # Two MTP modules, the shared expert's gate, one stage, no distributed optimizer.
    ("deepseek-v3-ep8-mtp2-shared-gate", DEEPSEEK_V3, 8, "mtp 2 shared-gate mbs 1 gbs 8 ep 8"),
    # Queries without a latent (no q_lora_rank).
    ("deepseek-v2-lite-ep8-dp16-distopt", V2_LITE, 16, "mbs 2 gbs 64 ep 8 distopt"),
    ("deepseek-v2-lite-tp2-ep4-sp-selective", V2_LITE, 8, "mbs 1 gbs 8 tp 2 ep 4 sp selective"),
]  # fmt: skip


def command_line(model: str, layout: str) -> list[str]:
    words = " ".join(SHORT.get(word, word) for word in layout.split())
    return f"{model} {words} --bf16".split()


def megatron_args(argv: list[str], world_size: int, vocab_size: int):
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    sys.argv = ["pretrain_gpt.py", *argv]
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        args = parse_args()
        validate_args(args, {})
    args.padded_vocab_size = vocab_size_with_padding(vocab_size, args, logging_enabled=False)
    return args


def run_case(argv: list[str], world_size: int, vocab_size: int) -> dict:
    args = megatron_args(argv, world_size, vocab_size)
    microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        weights, activations, total = report_theoretical_memory(
            args, num_microbatches=microbatches, verbose=True
        )
    flops = num_floating_point_operations(args, args.global_batch_size)
    return {
        "command_line": " ".join(argv), "world_size": world_size, "vocab_size": vocab_size,
        "padded_vocab_size": args.padded_vocab_size,
        "data_parallel_size": args.data_parallel_size, "num_microbatches": microbatches,
        "report": printed.getvalue().rstrip("\n").split("\n"),
        "weight_and_optimizer_mb": weights, "activation_mb": activations, "total_mb": total,
        "flops_per_iteration": flops,
    }  # fmt: skip


def main() -> None:
    import megatron.core

    cases = {
        name: run_case(command_line(model, layout), world_size, VOCAB[model])
        for name, model, world_size, layout in CASES
    }
    out = Path(__file__).with_name("cases.json")
    document = {"megatron_core": megatron.core.__version__, "cases": cases}
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{len(cases)} cases -> {out}")


if __name__ == "__main__":
    main()
