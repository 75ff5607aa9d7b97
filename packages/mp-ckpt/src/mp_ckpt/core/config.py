"""CheckpointConfig: the run's checkpoint settings, with Megatron-LM's argument names."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

__all__ = ["NON_PERSISTENT_SUBDIR", "CheckpointConfig"]

NON_PERSISTENT_SUBDIR = "non_persistent"
"""Megatron's folder of non-persistent checkpoints under save (and load)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = None
    """Directory to save checkpoints to (none saved when unset)."""

    load: str | None = None
    """Directory to load a checkpoint from (training starts from scratch when it holds none).
    A Hugging Face model directory (config.json and safetensors) is loaded as a fine-tuning
    start: each rank reads its own pieces of the weights, iteration 0, a fresh optimizer;
    the model's settings and the tokenizer come from the directory."""

    pretrained_checkpoint: str | None = None
    """Checkpoint to fine-tune from when load holds none (Megatron-LM's rule: loaded as
    with finetune); an mp checkpoint or a Hugging Face model directory. A restarted job
    resumes from load once it has saved there."""

    export_hf_dir: str | None = None
    """At the end of training, write the model as a Hugging Face directory here
    (config.json, safetensors, the tokenizer files), gathered a tensor at a time and
    written by rank 0 under a temporary name; an earlier export here is replaced."""

    save_interval: int | None = None
    """Save every this many iterations (and at the end of training)."""

    non_persistent_save_interval: int | None = None
    """Also save every this many iterations as a non-persistent checkpoint (Megatron's):
    under non_persistent_global_ckpt_dir, where only the newest is kept, for frequent,
    cheap restart points. Needs save and non_persistent_ckpt_type global."""

    non_persistent_ckpt_type: Literal["global", "local", "in_memory"] | None = None
    """global: non-persistent checkpoints are whole checkpoints under
    non_persistent_global_ckpt_dir, and a run resumes from the newer of it and load (the
    non-persistent one on a tie, as Megatron; ckpt_step picks from load alone). local and
    in_memory, per-rank checkpoints kept by NVIDIA Resiliency Extension's manager, are
    refused. None: no non-persistent checkpoints are saved or looked for."""

    non_persistent_global_ckpt_dir: str | None = None
    """Where global non-persistent checkpoints live; None: <save>/non_persistent for saves
    and <load>/non_persistent for loads (Megatron's default)."""

    override_ckpt_iteration: int | None = None
    """Resume as if the loaded checkpoint were of this iteration (Megatron's flag, to
    rewind or replay the data): the iteration and the consumed training samples (this
    iteration x global_batch_size, which must be the checkpoint's) are set from it, the
    weights, optimizer and scheduler are the checkpoint's. Not with finetune."""

    async_save: bool = False
    """Write checkpoints in the background after staging them on the host."""

    ckpt_keep_last: int | None = None
    """Keep only this many newest checkpoints under save (None: all)."""

    save_retain_interval: int | None = None
    """Keep every checkpoint whose iteration is a multiple of this, beside the newest
    ckpt_keep_last (or, without it, the newest one alone): the others are deleted as each
    save commits (Megatron's --save-retain-interval). None: ckpt_keep_last alone decides."""

    no_save_optim: bool = False
    """Do not save the optimizer state."""

    no_save_rng: bool = False
    """Do not save the random number generators' states."""

    no_load_optim: bool = False
    """Do not load the optimizer state (it starts anew)."""

    no_load_rng: bool = False
    """Do not restore the random number generators' states."""

    finetune: bool = False
    """Load the model only and start at iteration 0 (no optimizer, scheduler, RNG or
    consumed samples)."""

    ckpt_step: int | None = None
    """Load this iteration instead of the latest."""

    use_checkpoint_args: bool = False
    """Take the model's settings from the checkpoint being loaded."""

    use_tokenizer_model_from_checkpoint_args: bool = True
    """With use_checkpoint_args, also take its tokenizer_type and tokenizer_model
    (Megatron's default; a different one given is refused)."""

    use_mp_args_from_checkpoint_args: bool = False
    """With use_checkpoint_args, also take its tensor, pipeline (and virtual), expert
    parallel sizes (a different one given is refused)."""

    exit_on_missing_checkpoint: bool = False
    """Fail when load is set but holds no checkpoint (instead of starting from scratch)."""

    strict_load: bool = True
    """Every tensor the model asks for must be in the checkpoint and every saved one asked for."""

    dist_ckpt_strictness: (
        Literal["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                "raise_all", "return_unexpected", "return_all", "ignore_all"] | None
    ) = None  # fmt: skip
    """Megatron's --dist-ckpt-strictness, instead of strict_load: what a tensor the run asks
    for that the checkpoint lacks ("unexpected" in Megatron's words) and a saved one nobody
    asks for ("missing" there) do. raise_all raises on either (strict_load's rule);
    assume_ok_unexpected and raise_unexpected raise on the first and pass over the second;
    log_unexpected logs the first, log_all both, and the load goes on without them;
    ignore_all passes over both (--no-strict-load's rule). return_unexpected and return_all
    hand them to a caller of Megatron's load and are refused (log_unexpected / log_all
    report them). None: strict_load."""

    @property
    def load_mismatch(self) -> tuple[str, str] | None:
        """dist_ckpt_strictness as load_checkpoint's mismatch (None: strict_load's rule)."""
        return None if self.dist_ckpt_strictness is None else _MISMATCH[self.dist_ckpt_strictness]

    def __post_init__(self) -> None:
        strictness = self.dist_ckpt_strictness
        if strictness is not None:
            if strictness not in _MISMATCH:
                raise ValueError(f"dist_ckpt_strictness={strictness!r}: mp's load reports "
                                 "mismatches itself, returns none; use log_unexpected or "
                                 "log_all")  # fmt: skip
            if not self.strict_load:
                raise ValueError(
                    f"dist_ckpt_strictness={strictness!r} and strict_load=False "
                    "(--no-strict-load) both say how strict a load is: give one"
                )
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"save_interval={self.save_interval} must be >= 1")
        if self.ckpt_keep_last is not None and self.ckpt_keep_last < 1:
            raise ValueError(f"ckpt_keep_last={self.ckpt_keep_last} must be >= 1")
        retain = self.save_retain_interval
        if retain is not None and retain < 1:
            raise ValueError(f"save_retain_interval={retain} must be >= 1")
        if retain is not None and self.save_interval and retain % self.save_interval:
            raise ValueError(
                f"save_retain_interval={retain} is not a multiple of save_interval="
                f"{self.save_interval}: the checkpoints it keeps must be saved "
                "(Megatron-LM's rule)"
            )
        if self.ckpt_step is not None and self.ckpt_step < 0:
            raise ValueError(f"ckpt_step={self.ckpt_step} must be >= 0")
        self._check_non_persistent()
        if self.override_ckpt_iteration is not None:
            if self.override_ckpt_iteration < 0:
                raise ValueError(
                    f"override_ckpt_iteration={self.override_ckpt_iteration} must be >= 0"
                )
            if self.finetune:
                raise ValueError("override_ckpt_iteration sets the iteration of a resumed "
                                 "run; finetune starts at 0: give one")  # fmt: skip

    def non_persistent_dir(self, root: str | None) -> str | None:
        """Where the global non-persistent checkpoints of the run saving to (or loading
        from) `root` live; None without non_persistent_ckpt_type."""
        if self.non_persistent_ckpt_type is None:
            return None
        if self.non_persistent_global_ckpt_dir is not None:
            return self.non_persistent_global_ckpt_dir
        return None if root is None else os.path.join(root, NON_PERSISTENT_SUBDIR)

    def _check_non_persistent(self) -> None:
        kind, interval = self.non_persistent_ckpt_type, self.non_persistent_save_interval
        where = self.non_persistent_global_ckpt_dir
        for name in ("save", "load"):
            root = getattr(self, name)
            if where is not None and root is not None and _same_dir(where, root):
                raise ValueError(
                    f"non_persistent_global_ckpt_dir={where} is {name}: its checkpoints would "
                    f"replace {name}'s (only the newest non-persistent one is kept); give "
                    "another directory"
                )
        if kind is not None and kind != "global":
            raise ValueError(
                f"non_persistent_ckpt_type={kind!r}: per-rank local checkpoints need NVIDIA "
                "Resiliency Extension's checkpoint manager, which mp does not have; use "
                "global (whole checkpoints, the newest kept)"
            )
        if interval is None:
            return
        if interval < 1:
            raise ValueError(f"non_persistent_save_interval={interval} must be >= 1")
        if kind is None:
            raise ValueError(f"non_persistent_save_interval={interval} needs "
                             "non_persistent_ckpt_type global")  # fmt: skip
        if self.save is None:
            raise ValueError(f"non_persistent_save_interval={interval} saves only beside "
                             "save: set save")  # fmt: skip


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


# dist_ckpt_strictness -> (an asked tensor the checkpoint lacks, a saved one nobody asks for)
_MISMATCH = {
    "assume_ok_unexpected": ("raise", "ignore"),
    "raise_unexpected": ("raise", "ignore"),
    "log_unexpected": ("log", "ignore"),
    "log_all": ("log", "log"),
    "raise_all": ("raise", "raise"),
    "ignore_all": ("ignore", "ignore"),
}
