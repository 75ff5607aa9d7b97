"""ParallelConfig: how the world's ranks are divided, with Megatron's field names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mp_state.rank_generator import parse_order

__all__ = ["ParallelConfig"]


@dataclass(kw_only=True)
class ParallelConfig:
    """The parallel layout of a run. The data-parallel size is what is left of the world."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's weights (TP)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages the layers are divided into (PP)."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank for the interleaved schedule (VPP); None for none."""

    context_parallel_size: int = 1
    """Ranks that split each sequence (CP)."""

    hierarchical_context_parallel_sizes: list[int] | None = None
    """Two levels of context parallelism, [inner, outer] with inner x outer =
    context_parallel_size (Megatron's, for cp_comm_type "a2a+p2p"): consecutive CP ranks
    form the inner groups (cp_a2a: an all-to-all by heads, within a node), ranks inner
    apart the outer ones (cp_p2p: a ring, across nodes)."""

    expert_model_parallel_size: int = 1
    """Ranks that split the experts of a MoE layer (EP)."""

    expert_tensor_parallel_size: int | None = None
    """Ranks that split each expert's weights; None means the same as tensor_model_parallel_size."""

    decoder_first_pipeline_num_layers: int | None = None
    """Layers of the first pipeline stage when it should hold another number than the
    others (e.g. fewer, beside the embedding); the remaining layers are split evenly over
    the other stages. None: an even split."""

    decoder_last_pipeline_num_layers: int | None = None
    """Layers of the last pipeline stage (beside the output layer and the loss); as
    decoder_first_pipeline_num_layers."""

    account_for_embedding_in_pipeline_split: bool = False
    """The input embedding counts as one decoder layer when the layers are split evenly over
    the (virtual) pipeline stages: the first stage holds one layer fewer (Megatron's)."""

    account_for_loss_in_pipeline_split: bool = False
    """The output layer and the loss count as one decoder layer of the even split: the last
    stage holds one layer fewer (Megatron's)."""

    pipeline_model_parallel_layout: str | None = None
    """What each virtual pipeline stage holds, Megatron's layout string (e.g.
    "Et*3|(tt|)*6tmL": E embedding, t decoder layer, m multi-token prediction, L loss, "|"
    between stages; mp_pipeline.layout): the stages, a multiple of
    pipeline_model_parallel_size, give virtual_pipeline_model_parallel_size. None: the
    layers split evenly (or by decoder_first/last_pipeline_num_layers)."""

    num_distributed_optimizer_instances: int = 1
    """Instances of the distributed optimizer (Megatron's
    --num-distributed-optimizer-instances): each data-parallel (x context-parallel) group,
    and each expert data-parallel group, is cut into this many consecutive slices; the
    optimizer shards its state over a slice ("intra" groups) and the slices hold replicas
    of it, their gradients summed across slices ("inter" groups: the ranks at one position
    of every slice); under FSDP the parameters shard hybridly over the same slices. Fewer
    ranks in each reduce-scatter and all-gather, more memory per rank."""

    order: str = "tp-cp-ep-dp-pp"
    """Axes of the rank grid from fastest- to slowest-varying rank (Megatron's order string)."""

    distributed_timeout_minutes: int = 10
    """Timeout of every collective and of process-group creation, in minutes."""

    distributed_backend: Literal["nccl", "gloo"] | None = None
    """The torch.distributed backend; None: nccl on CUDA devices, gloo on CPUs (Megatron
    defaults to nccl, which needs CUDA)."""

    disable_gloo_process_groups: bool = False
    """Make no gloo twins of the data-parallel groups (Megatron's
    --disable-gloo-process-groups): on a NCCL run each is one more gloo communicator, for
    CPU-side collectives mp does not issue over them."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "distributed_timeout_minutes",
            "num_distributed_optimizer_instances",
        ):
            _require_positive_int(name, getattr(self, name))
        self._check_hierarchical_context_parallel()
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        _require_positive_int("expert_tensor_parallel_size", self.expert_tensor_parallel_size)

        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            if getattr(self, name) is None:
                continue
            _require_positive_int(name, getattr(self, name))
            if self.pipeline_model_parallel_size == 1:
                raise ValueError(f"{name}={getattr(self, name)} needs "
                                 "pipeline_model_parallel_size > 1, got 1")  # fmt: skip
        accounted = [name for name in ("account_for_embedding_in_pipeline_split",
                                       "account_for_loss_in_pipeline_split")
                     if getattr(self, name)]  # fmt: skip
        others = [name for name in ("decoder_first_pipeline_num_layers",
                                    "decoder_last_pipeline_num_layers",
                                    "pipeline_model_parallel_layout")
                  if getattr(self, name) is not None]  # fmt: skip
        if accounted and others:
            raise ValueError(f"{' and '.join(accounted)} with {' and '.join(others)}: both "
                             "place the layers on the stages; give one (Megatron-LM refuses "
                             "the pair too)")  # fmt: skip
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            _require_positive_int("virtual_pipeline_model_parallel_size", vpp)
            if self.pipeline_model_parallel_size == 1:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size={vpp} needs "
                    "pipeline_model_parallel_size > 1, got 1"
                )

        sizes = {
            "tp": self.tensor_model_parallel_size,
            "cp": self.context_parallel_size,
            "ep": self.expert_model_parallel_size,
            "dp": 1,  # derived from the world size; any size may stand in the order
            "pp": self.pipeline_model_parallel_size,
        }
        # The expert grid uses the same order with tp = expert_tp: that size must fit too.
        # Megatron's further rules (a pp-last order, or equal dense and expert data-parallel
        # sizes; the same pipeline groups) need the world size: plan_groups checks them.
        sizes["tp"] = max(sizes["tp"], self.expert_tensor_parallel_size)
        parse_order(self.order, sizes)

    def _check_hierarchical_context_parallel(self) -> None:
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is None:
            return
        sizes = self.hierarchical_context_parallel_sizes = list(sizes)
        for size in sizes:
            _require_positive_int("hierarchical_context_parallel_sizes", size)
        if len(sizes) != 2:
            raise ValueError(f"hierarchical_context_parallel_sizes={sizes}: mp's hierarchical "
                             "context parallelism has two levels, [all-to-all, ring]")  # fmt: skip
        if sizes[0] * sizes[1] != self.context_parallel_size:
            raise ValueError(f"hierarchical_context_parallel_sizes={sizes}: their product must "
                             f"be context_parallel_size={self.context_parallel_size}")  # fmt: skip

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size left for `world_size` ranks (Megatron's derivation)."""
        _require_positive_int("world_size", world_size)
        tp = self.tensor_model_parallel_size
        pp = self.pipeline_model_parallel_size
        cp = self.context_parallel_size
        if world_size % (tp * pp * cp):
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size={tp} "
                f"x pipeline_model_parallel_size={pp} x context_parallel_size={cp} = {tp * pp * cp}"
            )
        return world_size // (tp * pp * cp)

    def expert_data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size of expert layers: world / (expert_tp x ep x pp)."""
        dp = self.data_parallel_size(world_size)
        tp = self.tensor_model_parallel_size
        cp = self.context_parallel_size
        ep = self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size
        # Per pipeline stage, tp*cp*dp dense ranks are re-divided as etp*ep*edp expert ranks.
        dense = tp * cp * dp
        if dense % (etp * ep):
            if etp == tp and cp == 1:
                raise ValueError(
                    f"data_parallel_size={dp} (world size {world_size}) is not divisible by "
                    f"expert_model_parallel_size={ep}"
                )
            raise ValueError(
                f"tensor_model_parallel_size={tp} x context_parallel_size={cp} x "
                f"data_parallel_size={dp} = {dense} ranks per pipeline stage (world size "
                f"{world_size}) are not divisible by expert_tensor_parallel_size={etp} x "
                f"expert_model_parallel_size={ep} = {etp * ep}"
            )
        return dense // (etp * ep)


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
