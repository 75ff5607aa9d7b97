"""Text from a checkpoint: greedy, temperature, top-k and top-p sampling, at any TP size.

    torchrun --nproc-per-node 2 -m mp_gpt.generate --load runs/quickstart/checkpoints \\
        --tensor-model-parallel-size 2 --prompt "The function" --max-new-tokens 40

The model's settings come from the checkpoint (--use-checkpoint-args is
implied); the weights are loaded (resharded) for this TP size. The tokenizer
is the one the training run named; a checkpoint made by `mp-ckpt import-hf`
uses the tokenizer files it kept from the Hugging Face folder (tokenizer.json
as HuggingFaceTokenizer, else vocab.json + merges.txt as GPT2BPETokenizer) and
its model's vocabulary size. Every rank
computes the full-vocabulary logits (gathered over tensor-parallel ranks)
and draws with the same generator, so all ranks agree on each token; rank 0
prints the text.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import CheckpointReader, load_checkpoint, write_tokenizer_files
from mp_data import build_tokenizer, vocab_size_with_padding
from mp_layers import GPTModel, ModelGroups
from mp_train import parse_config

__all__ = ["generate", "main", "sample_next"]


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator) -> int:  # fmt: skip
    """One token id from the last position's logits [vocab]."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


@torch.no_grad()
def generate(model: GPTModel, ids: list[int], *, max_new_tokens: int, max_length: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eod: int | None = None, vocab_size: int | None = None) -> list[int]:  # fmt: skip
    """ids extended by up to max_new_tokens tokens (stops at eod). vocab_size: the
    tokenizer's; the rows padding the model's vocabulary beyond it are never drawn."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-max_length:]], device=next(model.parameters()).device)
        logits = model(window)[0, -1, :vocab_size].cpu()
        token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                            generator=generator)  # fmt: skip
        ids.append(token)
        if eod is not None and token == eod:
            break
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mp_gpt.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--load", required=True, help="checkpoint root (or its iteration dir)")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    args, rest = parser.parse_known_args(argv)
    text = run_generation(args, rest)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text)
    return 0


def run_generation(args, extra: list[str]) -> str:
    """Builds the model from the checkpoint and generates (collective under torchrun)."""
    config = parse_config([
        "--load", args.load, "--use-checkpoint-args", "--micro-batch-size", "1",
        "--train-iters", "1", "--mock-data",
        "--tensor-model-parallel-size", str(args.tensor_model_parallel_size), *extra,
    ])  # fmt: skip
    mp_state.init_distributed(config.parallel.distributed_timeout_minutes,
                              config.parallel.distributed_backend)  # fmt: skip
    state = mp_state.initialize(config.parallel)
    try:
        tokenizer, padded = _tokenizer_and_vocabulary(args.load, state.tp.size)
        gpt = config.gpt
        config.model.hidden_dropout = config.model.attention_dropout = 0.0
        positions = gpt.max_position_embeddings or gpt.seq_length
        device = mp_state.select_device().device
        model = GPTModel(config.model, "local", padded, positions, groups=ModelGroups.of(state),
                         parallel_output=False).to(device).eval()  # fmt: skip
        load_checkpoint(args.load, model.sharded_state_dict(), finetune=True, strict=False)
        ids = tokenizer.tokenize(args.prompt) if args.prompt else [tokenizer.eod]
        out = generate(model, ids, max_new_tokens=args.max_new_tokens, max_length=gpt.seq_length,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, eod=tokenizer.eod,
                       vocab_size=tokenizer.vocab_size)  # fmt: skip
        # The prompt's ids and the new ones detokenized together, as one text (a tokenizer
        # may join tokens with spaces or merge bytes across the boundary).
        kept = out if args.prompt else out[1:]
        return tokenizer.detokenize([t for t in kept if t != tokenizer.eod])
    finally:
        mp_state.destroy()


def _tokenizer_and_vocabulary(load: str, tp: int):
    """(tokenizer, the model's padded vocabulary size) of the checkpoint under `load`."""
    common = torch.load(CheckpointReader(load).directory / "common.pt", weights_only=False)
    data = (common.get("config") or {}).get("data")
    if data is not None:  # saved by mp's training: the run's tokenizer settings
        tokenizer = build_tokenizer(
            data["tokenizer_type"] or "NullTokenizer", vocab_file=data["vocab_file"],
            merge_file=data["merge_file"], tokenizer_model=data["tokenizer_model"],
            vocab_size=data["vocab_size"],
        )  # fmt: skip
        divisible = data["make_vocab_size_divisible_by"]
        return tokenizer, vocab_size_with_padding(tokenizer.vocab_size, divisible, tp)
    vocab = (common.get("model_config") or {}).get("vocab_size")
    if vocab is None:
        raise ValueError(f"{load}: common.pt names neither a tokenizer nor a vocabulary size")
    if vocab % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} does not divide the imported model's "
            f"vocab_size={vocab}"
        )
    with tempfile.TemporaryDirectory() as folder:
        names = {path.name for path in write_tokenizer_files(common, folder)}
        if "tokenizer.json" in names:
            tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
        elif {"vocab.json", "merges.txt"} <= names:
            tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=f"{folder}/vocab.json",
                                        merge_file=f"{folder}/merges.txt")  # fmt: skip
        else:
            raise ValueError(
                f"{load}: the checkpoint keeps no tokenizer.json nor vocab.json + merges.txt "
                f"(it has {sorted(names) or 'no tokenizer files'})"
            )
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"{load}: the tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}"
        )
    return tokenizer, vocab


if __name__ == "__main__":
    sys.exit(main())
