"""Loss scaling for fp16: a constant scale, or Megatron's dynamic scaler.

The loss is multiplied by the scale before the backward so that small fp16
gradients do not flush to zero; the optimizer divides the gradients by it
again and checks them for inf/nan. The dynamic scaler:

- on an overflowing step (any inf/nan): the step is skipped, the clean-step
  count restarts, and after `hysteresis` overflowing steps (not necessarily
  consecutive; the count refills after a growth) the scale is multiplied by
  backoff_factor, never below min_scale;
- after growth_interval (loss_scale_window) consecutive clean steps: the
  scale is multiplied by growth_factor and the hysteresis count refills.
"""

from __future__ import annotations

__all__ = ["ConstantGradScaler", "DynamicGradScaler"]


class ConstantGradScaler:
    """A fixed loss scale (config.loss_scale)."""

    def __init__(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"loss_scale={scale} must be > 0")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Nothing changes a constant scale."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """Megatron's dynamic loss scaler (see the module docstring)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError(
                f"initial_loss_scale={initial_scale} and min_loss_scale={min_scale} must be > 0"
            )
        if growth_factor <= 1:
            raise ValueError(f"growth_factor={growth_factor} must be > 1")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor={backoff_factor} must be in (0, 1)")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"loss_scale_window={growth_interval} and hysteresis={hysteresis} must be >= 1"
            )
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Adjusts the scale after a step; found_inf: the step overflowed (and was skipped)."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
