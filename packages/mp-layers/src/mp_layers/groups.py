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

from dataclasses import dataclass

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

    @classmethod
    def of(cls, state: ParallelState) -> ModelGroups:
        """This rank's groups in an initialized ParallelState."""
        return cls(tp=state.tp, cp=state.cp)

    @classmethod
    def single(cls) -> ModelGroups:
        """Groups of this process alone (no process group needed)."""
        return cls(tp=RankGroup("tp", (0,), 0, None), cp=RankGroup("cp", (0,), 0, None))
