"""MuonConfig: the Muon optimizer's settings (Megatron-LM's --muon-* flags), a base of
OptimizerConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mp_optim.muon import COEFFICIENT_TYPES

__all__ = ["MuonConfig"]


@dataclass(kw_only=True)
class MuonConfig:
    # Muon (optimizer="muon"): matrices orthogonalized, the rest by adam (mp_optim.muon).

    muon_momentum: float = 0.9
    """Muon's momentum (an EMA of the gradients)."""

    muon_nesterov: bool = False
    """Nesterov momentum: orthogonalize gradient + momentum x (EMA - gradient)."""

    muon_split_qkv: bool = True
    """Orthogonalize a fused query/key/value weight part by part (query, [gate,] key,
    value); Megatron's --muon-no-split-qkv clears it."""

    muon_scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    """The update of a [rows, cols] matrix is scaled by sqrt(max(rows, cols)) (spectral),
    sqrt(rows / cols) (unit_rms_norm) or sqrt(max(1, rows / cols)) (shape_scaling)."""

    muon_extra_scale_factor: float = 1.0
    """A further factor on the update (0.2 gives about AdamW's update size with spectral,
    Kimi's setting)."""

    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations."""

    muon_coefficient_type: str = "quintic"
    """The iterations' coefficient sets: simple, quintic, polar_express, cans, aol or
    deepseekv4."""

    muon_fp32_matmul_prec: Literal["low", "medium", "high"] = "medium"
    """medium: the iterations run in bf16 (Megatron's default); high: fp32 (TF32 allowed
    on a GPU). low is refused: torch has no such precision (Megatron's setting has no
    effect)."""

    muon_tp_mode: Literal["blockwise", "duplicated", "distributed"] = "duplicated"
    """A matrix split over tensor-parallel ranks: duplicated gathers it and every rank
    orthogonalizes it whole; distributed sums the Gram matrix over the ranks at each
    iteration; blockwise orthogonalizes each rank's block alone (the result then depends
    on the tensor-parallel size)."""

    muon_scalar_optimizer: Literal["adam", "lion"] = "adam"
    """The optimizer of the parameters Muon does not take (embeddings, the output layer,
    norms, biases, convolution kernels, Mamba's in_proj): adam, or lion (lion_beta1 and
    lion_beta2)."""

    use_layer_wise_distributed_optimizer: bool = False
    """Each data-parallel rank steps whole parameters, the updated ones broadcast from
    their rank after the step (Megatron's layer-wise distributed optimizer, what
    optimizer='muon' with use_distributed_optimizer becomes: Muon needs whole matrices).
    Gradients are all-reduced as without the distributed optimizer; the main parameters
    and the optimizer state are split over the ranks by parameter."""

    def _check_muon(self) -> None:
        """The Muon fields' rules, and Megatron's for the rest of the config with Muon
        (called by OptimizerConfig, whose fields `self` has)."""
        if self.muon_coefficient_type not in COEFFICIENT_TYPES:
            raise ValueError(
                f"muon_coefficient_type={self.muon_coefficient_type!r}: one of "
                f"{', '.join(COEFFICIENT_TYPES)} (custom coefficient sets are not taken)"
            )
        if self.muon_num_ns_steps < 1:
            raise ValueError(f"muon_num_ns_steps={self.muon_num_ns_steps}: at least 1")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum={self.muon_momentum}: in [0, 1)")
        if self.optimizer != "muon":
            if self.use_layer_wise_distributed_optimizer:
                raise ValueError("use_layer_wise_distributed_optimizer=True needs "
                                 "optimizer='muon'")  # fmt: skip
            return
        if self.fp16:
            raise ValueError("optimizer='muon' with fp16=True: Muon takes fp32 or bf16 "
                             "(as in Megatron); use bf16")  # fmt: skip
        if self.fully_sharded or self.use_megatron_fsdp or self.use_torch_fsdp2:
            raise ValueError(
                "optimizer='muon' under FSDP (use_megatron_fsdp, use_torch_fsdp2): Muon needs "
                "whole matrices, FSDP shards each one over the data-parallel ranks (Megatron "
                "refuses the pair too, at any sharding strategy); use the distributed "
                "optimizer or plain data parallelism"
            )
        if self.use_distributed_optimizer:  # Megatron's rule: whole parameters per rank
            self.use_distributed_optimizer = False
            self.use_layer_wise_distributed_optimizer = True
        if self.use_layer_wise_distributed_optimizer and self.overlap_param_gather:
            raise ValueError(
                "overlap_param_gather=True with optimizer='muon' and the distributed "
                "optimizer: mp's layer-wise distributed optimizer broadcasts the updated "
                "parameters right after the step, not overlapped; drop overlap_param_gather"
            )
        if self.muon_fp32_matmul_prec == "low":
            raise ValueError(
                "muon_fp32_matmul_prec='low': torch has no such float32 matmul precision "
                "(under Megatron-LM it changes nothing); use medium (bf16 iterations) or high"
            )
