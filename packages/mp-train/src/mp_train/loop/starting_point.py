"""Which checkpoint a run starts from (Megatron-LM's rules): `load` when it holds one,
else `pretrained_checkpoint` as a fine-tuning start, the non-persistent checkpoints'
folder when it is the newer; nothing without `load` or `pretrained_checkpoint`, as
Megatron-LM loads nothing then."""

from __future__ import annotations

import logging

from mp_ckpt import is_hf_directory, read_tracker

__all__ = ["starting_point"]

log = logging.getLogger("mp_train")


def _holds_checkpoint(path: str | None, step: int | None = None) -> bool:
    """Whether `path` holds something to load: an mp checkpoint (its tracker, or the
    iteration asked for) or a Hugging Face model directory."""
    return path is not None and (step is not None or is_hf_directory(path)
                                 or read_tracker(path) is not None)  # fmt: skip


def starting_point(ckpt) -> tuple[str, bool] | None:
    """(the directory a run loads, whether as a fine-tuning start), or None to start from
    scratch. Megatron-LM's rule: load when it holds a checkpoint, else
    pretrained_checkpoint with finetune; a Hugging Face directory is always a fine-tuning
    start (it holds no optimizer, scheduler or iteration). Without load and
    pretrained_checkpoint the run starts from scratch, whatever the non-persistent folder
    holds: Megatron-LM loads nothing then."""
    if ckpt.load is None and ckpt.pretrained_checkpoint is None:
        return None
    newer = _newer_non_persistent(ckpt)
    if newer is not None:
        return newer, ckpt.finetune
    if _holds_checkpoint(ckpt.load, ckpt.ckpt_step):
        return ckpt.load, ckpt.finetune or is_hf_directory(ckpt.load)
    if ckpt.pretrained_checkpoint is None:
        if ckpt.load is not None and ckpt.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"load={ckpt.load} holds no checkpoint")
        return None
    if not _holds_checkpoint(ckpt.pretrained_checkpoint):
        raise FileNotFoundError(
            f"no checkpoint under load={ckpt.load} nor under pretrained_checkpoint="
            f"{ckpt.pretrained_checkpoint} (an mp checkpoint or a Hugging Face directory)"
        )
    return ckpt.pretrained_checkpoint, True


def _newer_non_persistent(ckpt) -> str | None:
    """The non-persistent checkpoints' directory when its newest is at least as new as
    load's (Megatron's rule), or there is none under load; None otherwise, and when
    ckpt_step asks for an iteration of load."""
    where = ckpt.non_persistent_dir(ckpt.load)
    if where is None or ckpt.ckpt_step is not None:
        return None
    newest = read_tracker(where)
    if newest is None:
        return None
    persistent = None
    if ckpt.load is not None and not is_hf_directory(ckpt.load):
        persistent = read_tracker(ckpt.load)
    if persistent is not None and persistent > newest:
        log.info("the non-persistent checkpoint %s (iteration %d) is older than load's "
                 "(iteration %d)", where, newest, persistent)  # fmt: skip
        return None
    return where
