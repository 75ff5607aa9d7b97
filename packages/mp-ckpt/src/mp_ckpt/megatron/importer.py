"""Megatron-LM training checkpoints -> an mp checkpoint (model weights).

    import_megatron(src, out_root, iteration=None)   an mp checkpoint at iteration 0

read.py gives Megatron's tensors whole; logical.py renames and unfuses them to
mp's logical tensors, and settings.py reads the model's settings from the args.

The model's settings come from the saved args, under the names mp uses
(common["model_config"], as import-hf writes it); the tokenizer files the run
named (GPT-2 BPE, a local Hugging Face tokenizer) are kept when they are here.
A setting mp does not compute the same way (heterogeneous layers, several
load-balancing losses, ...) is refused with its name and value. With
with_optimizer, optimizer.py reads the Adam state (and, from a run with
--optimizer muon, Muon's momentum buffers: muon.py), which is renamed and
unfused like the weights (not of multi-token prediction modules under pipeline
parallelism: refused).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mp_ckpt.core.checkpointer import Checkpointer
from mp_ckpt.core.layout import checkpoint_dir
from mp_ckpt.core.reshard import write_streaming
from mp_ckpt.core.sharding import ShardedTensor
from mp_ckpt.hf.tokenizer import export_tokenizer
from mp_ckpt.megatron.logical import logical_from_megatron, logical_plan
from mp_ckpt.megatron.optimizer import mp_optimizer_state
from mp_ckpt.megatron.read import read_megatron

__all__ = ["import_megatron", "tokenizer_from_megatron"]


def tokenizer_from_megatron(args) -> dict | None:
    """common["tokenizer"] (as import-hf keeps it) from the files the Megatron run named:
    GPT2BPETokenizer's vocab_file / merge_file, HuggingFaceTokenizer's local
    tokenizer_model. None when the run used another tokenizer or the files are not here
    (a Megatron checkpoint does not hold its tokenizer)."""

    data = {name: getattr(args, name, None) for name in
            ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")}  # fmt: skip
    try:
        files, ids = export_tokenizer({"config": {"data": data}})
    except (FileNotFoundError, ValueError):
        return None
    return {"files": files, **ids} if files else None


def import_megatron(
    src: str | os.PathLike,
    out_root: str | os.PathLike,
    *,
    iteration: int | None = None,
    with_optimizer: bool = False,
    progress: bool = False,
) -> Path:
    """Writes an mp checkpoint (iteration 0, model only, as import-hf does) from a
    Megatron-LM training checkpoint (torch_dist or legacy torch, any TP x PP).
    common.pt holds the model's settings (common["model_config"]) and where it came
    from (imported_from, source_iteration). with_optimizer: also the Adam (and Muon)
    state, the scheduler and the training position (optimizer.py), at the source
    iteration, as mp's training checkpoints hold them, for a resume. progress: report
    the tensors written on stderr (progress.py; not with_optimizer, which saves them at
    once)."""
    model = read_megatron(src, iteration)
    common = {"iteration": 0, "model_config": None, "imported_from": str(model.directory),
              "source_iteration": model.iteration, "source_format": model.format}  # fmt: skip
    if with_optimizer:  # the Adam state is read whole, beside the weights
        pp = int(getattr(model.args, "pipeline_model_parallel_size", 1) or 1)
        if getattr(model.args, "mtp_num_layers", None) and pp > 1:
            raise ValueError(
                f"{model.directory}: --with-optimizer: the Adam state of multi-token "
                f"prediction modules under pipeline parallelism (PP {pp}: the last stage's "
                "copy of the embedding) is not read; import the weights without it"
            )
        logical, settings = logical_from_megatron(model)
        states, entries = mp_optimizer_state(model, logical)
        tensors = {**{k: t.contiguous() for k, t in logical.items()}, **states}
        pieces = {k: ShardedTensor(k, t, tuple(t.shape), (0,) * t.dim())
                  for k, t in tensors.items()}  # fmt: skip
        common["model_config"] = settings
        common.update(entries)
        _add_tokenizer(common, model.args)
        Checkpointer(out_root).save(common["iteration"], pieces, common=common)
        return checkpoint_dir(out_root, common["iteration"])
    # One tensor at a time: each logical tensor is read (one Megatron tensor, one layer),
    # cut and written before the next is read.
    plan, settings = logical_plan(model)
    common["model_config"] = settings
    _add_tokenizer(common, model.args)
    meta, producers, chunks = {}, {}, []
    for key, (shape, dtype, produce) in plan.items():
        name = f"{key}@{','.join('0' * len(shape))}"
        meta[name] = torch.empty(shape, dtype=dtype, device="meta")
        producers[name] = produce
        chunks.append({"key": key, "storage_key": name,
                       "dtype": str(dtype).removeprefix("torch."), "global_shape": list(shape),
                       "offset": [0] * len(shape), "shape": list(shape),
                       "flattened_range": None})  # fmt: skip
    return write_streaming(out_root, common["iteration"], meta, producers, [chunks], common,
                           None, progress=progress, description="import-megatron")  # fmt: skip


def _add_tokenizer(common: dict, args) -> None:
    tokenizer = tokenizer_from_megatron(args)
    if tokenizer is not None:
        common["tokenizer"] = tokenizer
