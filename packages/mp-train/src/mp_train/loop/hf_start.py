"""A run that starts from a Hugging Face model directory, and ends with one.

    load_hf_start(run, path, pieces)   fills this rank's pieces from the directory's
                                       weights (mp_ckpt.load_hf_pieces: each rank reads
                                       only the tensors of its own pieces)
    export_hf(run, pieces, common)     writes checkpoint.export_hf_dir from the ranks'
                                       pieces (mp_ckpt.export_hf_from_pieces)

The model's settings were taken from the directory's config.json when the run was
configured (configuration/hf_source.py); they are checked again here, for a RunConfig
built by other means. The directory's family, and, when the run's tokenizer is the
directory's, its tokenizer files and generation settings, travel with the run: its
saves record them (as `mp-ckpt import-hf` does) and its export writes them.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from mp_ckpt import ShardedTensor, export_hf_from_pieces, hf_directory_settings, load_hf_pieces
from mp_train.configuration.hf_source import hf_differences, is_directory_tokenizer
from mp_train.loop.setup import Run

__all__ = ["export_hf", "load_hf_start"]

log = logging.getLogger("mp_train")


def load_hf_start(run: Run, path: str, pieces: dict[str, ShardedTensor]) -> None:
    """Fills `pieces` from the Hugging Face directory `path` (collective); the run
    records the directory's family and, with its tokenizer, its tokenizer files."""
    _, settings = hf_directory_settings(path)
    differing = hf_differences(run.config, settings)
    rows = settings["vocab_size"]
    if rows != run.padded_vocab_size:
        differing.append(f"padded vocabulary: Hugging Face {rows} rows, this run "
                         f"{run.padded_vocab_size}")  # fmt: skip
    if differing:
        raise ValueError(f"the run's model differs from the Hugging Face model at {path}:\n  "
                         + "\n  ".join(differing))  # fmt: skip
    common = load_hf_pieces(path, pieces)
    run.family = common["family"]
    if is_directory_tokenizer(run.config.data, path):
        run.hf_files = {k: common[k] for k in ("tokenizer", "generation_config") if k in common}


def export_hf(run: Run, pieces: dict[str, ShardedTensor], common: dict) -> None:
    """Writes checkpoint.export_hf_dir (collective)."""
    out = run.config.checkpoint.export_hf_dir
    export_hf_from_pieces(pieces, common, out, device=run.device)
    if dist.get_rank() == 0:
        log.info("wrote the model as a Hugging Face directory to %s", out)
