"""Text (or token ids) from a checkpoint: batched prompts, a KV cache, greedy or sampled,
at any tensor- and pipeline-parallel size.

    python -m mp_gpt.generate --load runs/quickstart/checkpoints --prompt "The function" \\
        --prompt "A list" --max-new-tokens 40
    torchrun --nproc-per-node 2 -m mp_gpt.generate --load DIR --tensor-model-parallel-size 2 \\
        --prompt-token-ids 464,2068 --max-new-tokens 32 --output-format json

The model's settings come from the checkpoint (--use-checkpoint-args is implied); the
weights are loaded (resharded) for this layout. The tokenizer is the one the training
run named; a checkpoint made by `mp-ckpt import-hf` uses the tokenizer files it kept
(tokenizer.json as HuggingFaceTokenizer, else vocab.json + merges.txt as
GPT2BPETokenizer). A checkpoint without a tokenizer takes --prompt-token-ids and gives
token ids. Rank 0 prints: per prompt its text (text format), or one JSON object per
line (json format) with `prompt_token_ids`, `token_ids` (the new ones), `text` (when a
tokenizer is known), `logprobs` and `finish_reason` ("eod", "stop", "length").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence

import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import CheckpointReader, load_checkpoint, write_tokenizer_files
from mp_data import build_tokenizer, vocab_size_with_padding
from mp_gpt.generation import Completion, Sampling, generate_batch
from mp_layers import GPTModel, ModelGroups, building_on, skipping_draws
from mp_pipeline import stage_layers
from mp_train import batch_scheduling, launch_rank, parse_config, pipeline_segments

__all__ = ["Generator", "main", "run_generation"]


class Generator:
    """A checkpoint's model on this rank, ready to generate (collective: every rank of
    the layout builds one and calls `complete` with the same arguments). On a CPU its
    threads go under SCHED_BATCH, as a training run's do (`scheduling`: what was done;
    None on a GPU or with --no-cpu-batch-scheduling)."""

    def __init__(self, load: str, extra: Sequence[str] = ()) -> None:
        """extra: options for the run's settings (the layout: --tensor-model-parallel-size,
        --pipeline-model-parallel-size, --expert-model-parallel-size, ...)."""
        config = parse_config([
            "--load", load, "--use-checkpoint-args", "--micro-batch-size", "1",
            "--train-iters", "1", "--mock-data", *extra,
        ])  # fmt: skip
        parallel = config.parallel
        if parallel.virtual_pipeline_model_parallel_size:
            raise ValueError("generation runs without virtual pipeline stages")
        if parallel.context_parallel_size > 1:
            raise ValueError("generation runs without context parallelism")
        config.model.sequence_parallel = False
        config.model.hidden_dropout = config.model.attention_dropout = 0.0
        # A world this generator starts (a command under torchrun) is ended by close(); a
        # caller's own stays up.
        self._owns_world = not dist.is_initialized()
        info = mp_state.init_distributed(parallel.distributed_timeout_minutes,
                                         parallel.distributed_backend)  # fmt: skip
        # As a CPU training run does (each new token makes a few small collectives per
        # layer); before the rank groups, whose gloo threads inherit the policy.
        self.scheduling = None
        if info.device.type == "cpu" and config.training.cpu_batch_scheduling:
            self.scheduling = batch_scheduling()
        self.state = mp_state.initialize(parallel)
        try:
            self.tokenizer, padded = _tokenizer_and_vocabulary(load, self.state.tp.size)
            gpt = config.gpt
            self.max_length = gpt.max_position_embeddings or gpt.seq_length
            stage = stage_layers(
                config.model.num_layers, self.state.pp.size, self.state.pp.rank,
                num_layers_in_first_pipeline_stage=parallel.decoder_first_pipeline_num_layers,
                num_layers_in_last_pipeline_stage=parallel.decoder_last_pipeline_num_layers,
                segments=pipeline_segments(config),
            )  # fmt: skip
            device = mp_state.select_device().device
            # Every weight comes from the checkpoint (a strict load: a key it lacks is an
            # error, on every rank), so none is drawn first; built where it runs.
            with skipping_draws(), building_on(device):
                self.model = GPTModel(
                    config.model, "local", padded, self.max_length,
                    groups=ModelGroups.of(self.state), parallel_output=False,
                    pre_process=stage.pre_process, post_process=stage.post_process,
                    layer_offset=stage.offset, num_layers=stage.count,
                ).to(device).eval()  # fmt: skip
            load_checkpoint(load, self.model.sharded_state_dict(), finetune=True, strict=True)
        except BaseException:
            self.close()
            raise
        self.vocab_size = self.tokenizer.vocab_size if self.tokenizer is not None else padded
        self.eod = self.tokenizer.eod if self.tokenizer is not None else None

    def complete(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                 sampling: Sequence[Sampling], stop_strings: Sequence[str] = (),
                 prompt_logprobs: bool = False) -> list[Completion]:  # fmt: skip
        """Every prompt's completion (mp_gpt.generation.generate_batch); a stop string
        ends a sequence once the text of its new tokens holds it."""
        stop = None
        if stop_strings:
            if self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this checkpoint has none")

            def stop(i: int, tokens: list[int]) -> bool:
                text = self.tokenizer.detokenize(tokens)
                return any(s in text for s in stop_strings)

        return generate_batch(
            self.model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, eod=self.eod,
            vocab_size=self.vocab_size, max_length=self.max_length, pp_group=self.state.pp,
            stop=stop, prompt_logprobs=prompt_logprobs,
        )  # fmt: skip

    def text(self, completion: Completion, stop_strings: Sequence[str] = ()) -> str:
        """The new tokens' text, without the end-of-document token, cut before the first
        stop string."""
        kept = [t for t in completion.tokens if t != self.eod]
        return _cut(self.tokenizer.detokenize(kept), stop_strings)

    def close(self) -> None:
        """Ends the model's process groups, and the default one when this generator
        started it (collective: every rank calls it); the generator cannot generate after.

        Each gloo group's worker threads are joined here, when the last reference to the
        group goes: left to the interpreter's exit, a worker thread releasing a finished
        collective's Python tensors after finalization has begun aborts the process
        ("terminate called without an active exception")."""
        mp_state.destroy()  # a barrier first: no peer is still sending to this rank
        self.model = self.state = None  # the groups' last references
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mp_gpt.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--load", required=True, help="checkpoint root (or its iteration dir)")
    parser.add_argument("--prompt", action="append", default=[],
                        help="a prompt's text (repeat for a batch)")  # fmt: skip
    parser.add_argument("--prompt-token-ids", action="append", default=[], type=_ids,
                        help="a prompt as comma-separated token ids (repeatable)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i: seed + i)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--output-format", choices=("text", "json"), default="text")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return parser


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids") from None
    if not ids:
        raise argparse.ArgumentTypeError("an empty list of token ids")
    return ids


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns 0, or 2 with one line on stderr for a request it cannot
    meet (no tokenizer for text prompts, a prompt too long for the model, ...)."""
    try:
        text = run_generation(argv)
    except ValueError as error:
        print(f"error: mp_gpt.generate: {error}", file=sys.stderr)
        return 2
    if launch_rank() == 0:  # the world has ended: the rank torchrun gave
        print(text)
    return 0


def run_generation(argv: list[str] | None = None) -> str:
    """Builds the model from the checkpoint and generates as the command line `argv`
    says (collective under torchrun); returns what rank 0 prints."""
    args, extra = _parser().parse_known_args(argv)
    layout = ["--tensor-model-parallel-size", str(args.tensor_model_parallel_size),
              "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size)]  # fmt: skip
    generator = Generator(args.load, [*layout, *extra])
    try:
        texts, stops = args.prompt, args.stop
        if texts and generator.tokenizer is None:
            raise ValueError(f"{args.load}: the checkpoint keeps no tokenizer: give the prompts "
                             "as --prompt-token-ids")  # fmt: skip
        prompts = [generator.tokenizer.tokenize(t) if t else [generator.eod] for t in texts]
        prompts += args.prompt_token_ids
        if not prompts:
            if generator.eod is None:
                raise ValueError("no prompt given, and no end-of-document token to start from")
            prompts, texts = [[generator.eod]], [""]
        sampling = [Sampling(args.temperature, args.top_k, args.top_p, args.seed + i)
                    for i in range(len(prompts))]  # fmt: skip
        completions = generator.complete(prompts, max_new_tokens=args.max_new_tokens,
                                         sampling=sampling, stop_strings=stops)  # fmt: skip
        if args.output_format == "json":
            return "\n".join(json.dumps(_record(generator, c, stops)) for c in completions)
        if generator.tokenizer is None:
            return "\n".join(" ".join(map(str, c.tokens)) for c in completions)
        shown = []
        for i, completion in enumerate(completions):
            if i < len(texts) and texts[i]:
                # The prompt's ids and the new ones detokenized together, as one text (a
                # tokenizer may join tokens with spaces or merge bytes across them).
                whole = generator.tokenizer.detokenize(
                    [t for t in completion.prompt + completion.tokens if t != generator.eod]
                )
                shown.append(_cut(whole, stops, len(texts[i])))
            else:
                shown.append(generator.text(completion, stops))
        return "\n\n".join(shown)
    finally:
        generator.close()


def _cut(text: str, stops: Sequence[str], start: int = 0) -> str:
    """text cut before the first stop string found after position `start`."""
    cuts = [text.index(s, start) for s in stops if s in text[start:]]
    return text[: min(cuts)] if cuts else text


def _record(generator: Generator, completion: Completion, stops: list[str]) -> dict:
    record = {"prompt_token_ids": completion.prompt, "token_ids": completion.tokens}
    if generator.tokenizer is not None:
        record["text"] = generator.text(completion, stops)
    record["logprobs"] = completion.logprobs
    record["finish_reason"] = completion.finish_reason
    return record


def _tokenizer_and_vocabulary(load: str, tp: int):
    """(tokenizer or None, the model's padded vocabulary size) of the checkpoint under
    `load`; None when an imported checkpoint kept no tokenizer files."""
    common = torch.load(CheckpointReader(load).directory / "common.pt", weights_only=False)
    data = (common.get("config") or {}).get("data")
    if data is not None:  # saved by mp's training: the run's tokenizer settings
        kind, vocab_size = data["tokenizer_type"] or "NullTokenizer", data["vocab_size"]
        if kind == "NullTokenizer" and "null_tokenizer_eod_id" not in data:
            vocab_size += 1  # saved when NullTokenizer's eod was vocab_size, after the ids
        tokenizer = build_tokenizer(
            kind, vocab_file=data["vocab_file"], merge_file=data["merge_file"],
            tokenizer_model=data["tokenizer_model"], vocab_size=vocab_size,
            null_tokenizer_eod_id=data.get("null_tokenizer_eod_id"),
            null_tokenizer_pad_id=data.get("null_tokenizer_pad_id", -1),
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
            return None, vocab  # token ids in and out
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"{load}: the tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}"
        )
    return tokenizer, vocab


if __name__ == "__main__":
    sys.exit(main())
