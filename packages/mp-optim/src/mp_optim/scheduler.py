"""The learning-rate and weight-decay schedule, with Megatron-LM's semantics.

`OptimizerParamScheduler` sets `lr` and `weight_decay` in every param group of
an optimizer (anything with a `param_groups` list of dicts) from a step count.

Steps are whatever the caller counts. The training loop counts samples: after
each iteration it calls `scheduler.step(increment=global_batch_size)`, and
`get_optimizer_param_scheduler` converts iteration-based settings to samples
(lr_decay_iters * global_batch_size, ...), so one schedule serves both kinds
of run and stays right when the batch size ramps up.

As in Megatron, each param group's dict may override the schedule for that
group: `max_lr`, `min_lr` (the lr schedule's ends), `start_wd`, `end_wd` (the
weight-decay schedule's ends), and the multipliers `lr_mult`, `wd_mult`
applied to the scheduled values (e.g. wd_mult=0 for biases and norms).

The learning rate warms up linearly from init_lr to max_lr over
lr_warmup_steps, then decays to min_lr by lr_decay_steps and stays there.
Decay styles: constant, linear, cosine (Loshchilov & Hutter, SGDR),
inverse-square-root (Vaswani et al.), and WSD (warmup-stable-decay, Hu et al.,
MiniCPM): max_lr until the last wsd_decay_steps, then an annealing phase.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

__all__ = ["OptimizerParamScheduler", "get_optimizer_param_scheduler", "settled"]

_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
_WD_STYLES = ("constant", "linear", "cosine")

# Keys of the saved state, each with the names older Megatron checkpoints used
# for it; an older name, when present, wins (as Megatron reads them).
_CHECKPOINT_KEYS = {
    "max_lr": ("start_lr",),
    "min_lr": (),
    "lr_warmup_steps": ("warmup_iter", "warmup_steps"),
    "lr_decay_steps": ("end_iter", "decay_steps"),
    "lr_decay_style": ("decay_style",),
}
_WD_KEYS = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")
_WSD_KEYS = ("wsd_decay_steps", "lr_wsd_decay_style")
# Settings a user does not set directly: the mismatch message says where they come from.
_DERIVED_FROM = {
    "lr_decay_steps": " (in samples: lr_decay_iters, or train_iters when it is unset, x the "
    "global batch; lr_decay_samples or train_samples in a sample-based run)",
    "wd_incr_steps": " (in samples: train_iters x the global batch, or train_samples)",
    "lr_warmup_steps": " (in samples: lr_warmup_iters x the global batch, lr_warmup_samples, "
    "or lr_warmup_fraction of the decay)",
    "wsd_decay_steps": " (in samples: lr_wsd_decay_iters x the global batch, or "
    "lr_wsd_decay_samples)",
}


class HasParamGroups(Protocol):
    """An optimizer as the scheduler sees it: a list of param-group dicts."""

    param_groups: list[dict[str, Any]]


class OptimizerParamScheduler:
    """Anneals the learning rate and weight decay of every param group.

    Arguments and behaviour are Megatron-core's OptimizerParamScheduler; the
    constructor applies step 0 at once so the groups hold their first values.
    On load_state_dict, override_opt_param_scheduler keeps this object's
    settings, use_checkpoint_opt_param_scheduler takes the checkpoint's, and
    with neither the two must agree.
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: float,
        lr_decay_steps: float,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: float,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: float | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        _check(min_lr >= 0, f"min_lr={min_lr} must be >= 0")
        _check(max_lr >= min_lr, f"max_lr={max_lr} must be >= min_lr={min_lr}")
        _check(init_lr <= max_lr, f"init_lr={init_lr} must be <= max_lr={max_lr}")
        _check(lr_decay_steps > 0, f"lr_decay_steps={lr_decay_steps} must be > 0")
        _check(
            lr_warmup_steps < lr_decay_steps,
            f"lr_warmup_steps={lr_warmup_steps} must be < lr_decay_steps={lr_decay_steps}",
        )
        _choice("lr_decay_style", lr_decay_style, _DECAY_STYLES)
        if lr_decay_style == "WSD":
            _check(
                wsd_decay_steps is not None and 0 < wsd_decay_steps <= lr_decay_steps,
                f"wsd_decay_steps={wsd_decay_steps} must be in (0, "
                f"lr_decay_steps={lr_decay_steps}] when lr_decay_style='WSD'",
            )
            _choice("lr_wsd_decay_style", lr_wsd_decay_style, _WSD_STYLES)
        _check(start_wd >= 0, f"start_wd={start_wd} must be >= 0")
        _check(end_wd >= start_wd, f"end_wd={end_wd} must be >= start_wd={start_wd}")
        _choice("wd_incr_style", wd_incr_style, _WD_STYLES)
        if wd_incr_style == "constant":
            _check(
                start_wd == end_wd,
                f"wd_incr_style='constant' needs start_wd == end_wd, got {start_wd} and {end_wd}",
            )
        else:
            _check(wd_incr_steps > 0, f"wd_incr_steps={wd_incr_steps} must be > 0")
        _check(
            not (override_opt_param_scheduler and use_checkpoint_opt_param_scheduler),
            "override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=True "
            "are exclusive: choose one",
        )
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_lr(self, param_group: dict[str, Any]) -> float:
        """The learning rate at num_steps for this group, before its lr_mult."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n, warmup = self.num_steps, self.lr_warmup_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5
            return max(min_lr, lr)
        ratio = (n - warmup) / (self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff()
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self) -> float:
        # Stable at max_lr, then anneal over the last wsd_decay_steps.
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        r = (self.num_steps - anneal_start) / self.wsd_decay_steps
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - r
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * r) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * 0.5**r - 1.0
        return 1.0 - math.sqrt(r)

    def get_wd(self, param_group: dict[str, Any] | None = None) -> float:
        """The weight decay at num_steps for this group (or the defaults), before wd_mult."""
        group = param_group or {}
        start_wd = group.get("start_wd", self.start_wd)
        end_wd = group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def step(self, increment: float) -> None:
        """Advance by increment steps (iterations or samples) and set every group's lr and wd."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """The schedule's settings and position, for a checkpoint."""
        keys = [*_CHECKPOINT_KEYS, *_WD_KEYS]
        if self.wsd_decay_steps is not None:
            keys += _WSD_KEYS
        return {"num_steps": self.num_steps} | {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position, and the settings as the override / use-checkpoint flags say.

        Reads checkpoints of older Megatron versions too (start_lr, warmup_iter,
        end_iter, decay_style, num_iters, and no weight-decay settings).
        """
        for key, old_names in _CHECKPOINT_KEYS.items():
            value = _lookup(state_dict, key, old_names)
            setattr(self, key, self._check_and_set(getattr(self, key), value, key))
        for keys in (_WD_KEYS, _WSD_KEYS):
            if keys[0] in state_dict:
                for key in keys:
                    value = state_dict[key]
                    setattr(self, key, self._check_and_set(getattr(self, key), value, key))
        self.num_steps = _lookup(state_dict, "num_steps", ("num_iters",))
        self.step(0)

    def _check_and_set(self, class_value: Any, checkpoint_value: Any, name: str) -> Any:
        derived = _DERIVED_FROM.get(name, "")
        return settled(
            class_value, checkpoint_value, override=self.override_opt_param_scheduler,
            use_checkpoint=self.use_checkpoint_opt_param_scheduler,
            mismatch=f"{name}={class_value!r} differs from the checkpoint's {name}="
            f"{checkpoint_value!r}{derived}; to go on with this run's value pass "
            "--override-opt-param-scheduler (override_opt_param_scheduler), to keep the "
            "checkpoint's pass --use-checkpoint-opt-param-scheduler "
            "(use_checkpoint_opt_param_scheduler)",
        )  # fmt: skip


def settled(ours: Any, saved: Any, *, override: bool, use_checkpoint: bool, mismatch: str) -> Any:
    """A schedule value on resume, by Megatron's rule: this run's with override
    (--override-opt-param-scheduler), the checkpoint's with use_checkpoint
    (--use-checkpoint-opt-param-scheduler); with neither they must agree, else
    ValueError(mismatch)."""
    if override:
        return ours
    if not use_checkpoint and ours != saved:
        raise ValueError(mismatch)
    return saved


def get_optimizer_param_scheduler(
    config: Any,
    optimizer: HasParamGroups,
    *,
    global_batch_size: int,
    train_iters: int | None = None,
    train_samples: int | None = None,
) -> OptimizerParamScheduler:
    """Build the scheduler for an OptimizerConfig, counting steps in samples.

    Give exactly one of train_iters (iteration-based run: iteration settings
    are multiplied by global_batch_size) or train_samples (sample-based run).
    The loop calls scheduler.step(increment=global_batch_size) after each
    iteration.
    """
    if (train_iters is None) == (train_samples is None):
        raise ValueError(
            f"give exactly one of train_iters={train_iters} and train_samples={train_samples}"
        )
    if config.lr is None:
        raise ValueError("lr=None: the optimizer config needs a peak learning rate")
    if train_iters is not None:
        _check(train_iters > 0, f"train_iters={train_iters} must be > 0")
        decay_iters = train_iters if config.lr_decay_iters is None else config.lr_decay_iters
        lr_decay_steps = decay_iters * global_batch_size
        wd_incr_steps = train_iters * global_batch_size
        wsd_decay_steps = None
        if config.lr_wsd_decay_iters is not None:
            wsd_decay_steps = config.lr_wsd_decay_iters * global_batch_size
        lr_warmup_steps = config.lr_warmup_iters * global_batch_size
    else:
        _check(train_samples > 0, f"train_samples={train_samples} must be > 0")
        decay_samples = config.lr_decay_samples
        lr_decay_steps = train_samples if decay_samples is None else decay_samples
        wd_incr_steps = train_samples
        wsd_decay_steps = config.lr_wsd_decay_samples
        lr_warmup_steps = config.lr_warmup_samples
    if config.lr_warmup_fraction is not None:
        lr_warmup_steps = config.lr_warmup_fraction * lr_decay_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr_warmup_init,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.start_wd,
        end_wd=config.end_wd,
        wd_incr_steps=wd_incr_steps,
        wd_incr_style=config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=config.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=config.lr_wsd_decay_style,
    )


def _lookup(state_dict: dict[str, Any], key: str, old_names: tuple[str, ...]) -> Any:
    for name in (*old_names, key):
        if name in state_dict:
            return state_dict[name]
    raise KeyError(f"the scheduler state has none of {', '.join((*old_names, key))}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name}={value!r} must be one of {', '.join(choices)}")
