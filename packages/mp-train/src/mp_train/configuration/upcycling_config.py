"""UpcyclingConfig: a dense checkpoint turned into a MoE model at the start of a run
(Megatron-LM's --moe-use-upcycling), a base of TrainingConfig; `check_upcycling` holds its
rules. loop/upcycling.py does the conversion."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UpcyclingConfig", "check_upcycling"]


@dataclass(kw_only=True)
class UpcyclingConfig:
    moe_use_upcycling: bool = False
    """The run's start is a dense model's checkpoint (load, else pretrained_checkpoint),
    turned into this MoE model: every expert of a MoE layer starts from the dense MLP of
    that layer (a 1/granularity slice of it with moe_upcycling_granularity), scaled so
    that the MoE layer computes what the dense MLP did; the router keeps its own
    initialization (Megatron-LM's sparse upcycling). The run saves the converted model
    at iteration 1 under `save`, which must not hold a checkpoint yet, then trains from
    there; its later runs resume from that checkpoint without the flag. The optimizer's
    and the RNG's states are not loaded (no_load_optim and no_load_rng are set, as in
    Megatron-LM)."""

    moe_upcycling_granularity: int = 1
    """How many experts each dense MLP is cut into (Megatron-LM's granular upcycling):
    moe_ffn_hidden_size is the dense ffn_hidden_size divided by it, and num_moe_experts a
    multiple of it; 1 copies the whole MLP into every expert."""


def check_upcycling(training, model, checkpoint) -> None:
    """A MoE model, a dense checkpoint to start from and a place to save the converted
    model (Megatron-LM's rules), and a granularity that divides the experts."""
    granularity = training.moe_upcycling_granularity
    if granularity < 1:
        raise ValueError(f"moe_upcycling_granularity={granularity} must be >= 1")
    if not training.moe_use_upcycling:
        if granularity != 1:
            raise ValueError(
                f"moe_upcycling_granularity={granularity} cuts each dense MLP into experts "
                "when upcycling: it needs moe_use_upcycling"
            )
        return
    if model.num_moe_experts is None:
        raise ValueError(
            "moe_use_upcycling turns a dense checkpoint into a MoE model: it needs num_moe_experts"
        )
    if model.num_moe_experts % granularity:
        raise ValueError(
            f"moe_use_upcycling: num_moe_experts={model.num_moe_experts} is not a multiple "
            f"of moe_upcycling_granularity={granularity} (each dense MLP becomes "
            f"{granularity} experts)"
        )
    if checkpoint.save is None:
        raise ValueError(
            "moe_use_upcycling saves the converted model before training: it needs save "
            "(Megatron-LM's rule)"
        )
    if checkpoint.load is None and checkpoint.pretrained_checkpoint is None:
        raise ValueError(
            "moe_use_upcycling starts from a dense model's checkpoint: give it with load "
            "(or pretrained_checkpoint)"
        )
