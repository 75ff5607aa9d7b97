"""ModelGroups: the process groups a model's layers communicate over, as one value.

Model constructors (GPTModel, TransformerBlock, TransformerLayer, SelfAttention)
take this bundle instead of one argument per parallelism; each layer reads the
group it needs. The tensor-parallel primitives below them still take the one group
they use. A parallelism of degree 1 is a group of one rank, which every layer
handles as the plain case.

    groups = ModelGroups.of(mp_state.current())     # under torchrun
    groups = ModelGroups.single()                    # one process, no collectives
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mp_state import ParallelState, RankGroup

__all__ = ["ModelGroups"]


@dataclass(frozen=True)
class ModelGroups:
    tp: RankGroup
    """Tensor (and sequence) parallelism: the layers' weights and, with sequence
    parallelism, the activations between them."""

    cp: RankGroup
    """Context parallelism: the ranks that hold the parts of each sequence; attention
    runs across them."""

    ep: RankGroup = field(default_factory=lambda: _alone("ep"))
    """Expert parallelism: the ranks that divide a MoE layer's experts among them; tokens
    travel across it to their experts."""

    expert_tp: RankGroup = field(default_factory=lambda: _alone("expert_tp"))
    """Expert tensor parallelism: the ranks that split each expert's weights."""

    tp_ep: RankGroup = field(default_factory=lambda: _alone("tp_ep"))
    """expert_tp x ep: the ranks whose tokens share one set of experts (the all-gather
    dispatcher gathers over it)."""

    tp_cp: RankGroup = field(default_factory=lambda: _alone("tp_cp"))
    """tp x cp: the ranks holding the parts of one set of sequences; the routers' balancing
    and z losses count tokens over it."""

    tp_dp_cp: RankGroup = field(default_factory=lambda: _alone("tp_dp_cp"))
    """tp x dp x cp: every rank of this pipeline stage; the global load-balancing loss
    counts its tokens over it."""

    cp_levels: tuple[RankGroup, RankGroup] | None = None
    """Hierarchical context parallelism (cp_comm_type "a2a+p2p"): the inner CP group
    (consecutive CP ranks, an all-to-all by heads) and the outer one (a ring); None
    without mp-state's hierarchical_context_parallel_sizes."""

    @classmethod
    def of(cls, state: ParallelState) -> ModelGroups:
        """This rank's groups in an initialized ParallelState."""
        levels = None if state.cp_a2a is None else (state.cp_a2a, state.cp_p2p)
        return cls(
            tp=state.tp, cp=state.cp, ep=state.ep, expert_tp=state.expert_tp, tp_ep=state.tp_ep,
            tp_cp=state.tp_cp, tp_dp_cp=state.tp_dp_cp, cp_levels=levels,
        )  # fmt: skip

    @classmethod
    def single(cls) -> ModelGroups:
        """Groups of this process alone (no process group needed)."""
        return cls(tp=_alone("tp"), cp=_alone("cp"))


def _alone(kind: str) -> RankGroup:
    return RankGroup(kind, (0,), 0, None)
