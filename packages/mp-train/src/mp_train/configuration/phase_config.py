"""PhaseConfig: training in phases, each on data of its own (Megatron-LM's
--phase-transition-iterations), a base of TrainingConfig; `check_phases` holds its rules.
loop/phases.py says which samples each phase reads."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PhaseConfig", "check_phases"]


@dataclass(kw_only=True)
class PhaseConfig:
    phase_transition_iterations: str | None = None
    """Iterations that end a training phase, comma-separated ("1000,5000"; Megatron's).
    The run saves and exits at each; resumed (with the next phase's data, say), it builds
    its training samples for this phase alone and reads them from the start of the phase,
    rather than at the consumed samples of the whole run. Needs a constant
    global_batch_size, the checkpoint's."""

    @property
    def phase_transitions(self) -> tuple[int, ...]:
        """phase_transition_iterations as sorted iterations (none when unset)."""
        text = self.phase_transition_iterations
        if text is None:
            return ()
        try:
            iterations = sorted(int(part) for part in str(text).split(","))
        except ValueError:
            raise ValueError(
                f"phase_transition_iterations={text!r} must be iterations separated by "
                "commas, e.g. '1000,5000'"
            ) from None
        return tuple(iterations)


def check_phases(training) -> None:
    """Positive, distinct iterations before the last one, under a constant global batch
    (Megatron's requirement: a phase's samples are counted in global batches)."""
    transitions = training.phase_transitions
    if not transitions:
        return
    given = f"phase_transition_iterations={training.phase_transition_iterations!r}"
    if transitions[0] < 1 or len(set(transitions)) < len(transitions):
        raise ValueError(f"{given}: the iterations must be distinct and >= 1")
    if training.train_iters is not None and transitions[-1] >= training.train_iters:
        raise ValueError(
            f"{given}: a phase must end before train_iters={training.train_iters}, where "
            "training ends anyway"
        )
    varying = [name for name in ("rampup_batch_size", "step_batch_size_schedule")
               if getattr(training, name) is not None]  # fmt: skip
    if varying:
        raise ValueError(f"{given} counts each phase's samples in global batches: not with "
                         f"{varying[0]}")  # fmt: skip
