"""ValidationConfig: when the loop evaluates and over what (Megatron-LM's
--start-eval-at-iter, --full-validation, --multiple-validation-sets,
--validation-set-names), a base of TrainingConfig; `check_validation` holds the rules
that span the data settings. loop/full_validation.py runs full validation."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ValidationConfig", "check_validation"]


@dataclass(kw_only=True)
class ValidationConfig:
    start_eval_at_iter: int | None = None
    """Evaluate during training only from this iteration on (Megatron's): the evaluations
    of earlier multiples of eval_interval are skipped (and their samples not built); the
    final evaluation stays. None: from the first eval_interval."""

    full_validation: bool = False
    """Each evaluation reads the whole validation split once, from its start (eval_iters is
    then the split's global batches: the last one padded with samples that count no loss),
    instead of eval_iters global batches that continue where the last evaluation stopped."""

    multiple_validation_sets: bool = False
    """Evaluate each dataset of valid_data_path on its own, logged as validation-<name>
    (Megatron's; needs full_validation and two or more unweighted prefixes)."""

    validation_set_names: list[str] | None = None
    """The names of multiple_validation_sets' datasets, one each, in valid_data_path's
    order; None: their indices 0, 1, ..."""


def check_validation(training, data) -> None:
    """The rules between the validation fields and the data (Megatron's): several sets need
    full validation and valid_data_path of unweighted prefixes; the names their number."""
    start = training.start_eval_at_iter
    if start is not None and (start < 0 or training.eval_interval is None):
        raise ValueError(f"start_eval_at_iter={start} must be >= 0 and needs eval_interval "
                         f"(given {training.eval_interval})")  # fmt: skip
    names = training.validation_set_names
    if names is not None and not training.multiple_validation_sets:
        raise ValueError(f"validation_set_names={names} needs multiple_validation_sets")
    if not training.multiple_validation_sets:
        return
    if not training.full_validation:
        raise ValueError("multiple_validation_sets needs full_validation (Megatron-LM's "
                         "rule: each set is read whole at each evaluation)")  # fmt: skip
    paths = data.valid_data_path or []
    if len(paths) < 2 or any(_is_number(p) for p in paths):
        raise ValueError(
            f"multiple_validation_sets needs valid_data_path of two or more prefixes without "
            f"weights, got {paths}"
        )
    if names is not None and len(names) != len(paths):
        raise ValueError(f"validation_set_names has {len(names)} names for the "
                         f"{len(paths)} datasets of valid_data_path")  # fmt: skip


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
