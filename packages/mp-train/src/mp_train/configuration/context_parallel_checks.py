"""The rules between the model's cp_comm_type and mp-state's hierarchical context
parallelism (validate calls `check_hierarchical_context_parallel`)."""

from __future__ import annotations

from mp_layers import kv_heads_per_rank

__all__ = ["check_hierarchical_context_parallel"]


def check_hierarchical_context_parallel(config) -> None:
    """cp_comm_type "a2a+p2p" needs hierarchical_context_parallel_sizes (Megatron's rule);
    the sizes without it would build groups no attention uses; the inner size splits each
    tensor-parallel rank's query groups."""
    parallel, model = config.parallel, config.model
    sizes, comm = parallel.hierarchical_context_parallel_sizes, model.cp_comm_type
    if comm == "a2a+p2p" and sizes is None:
        raise ValueError("cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes "
                         "(--hierarchical-context-parallel-sizes INNER OUTER)")  # fmt: skip
    if sizes is None:
        return
    if comm != "a2a+p2p":
        raise ValueError(f"hierarchical_context_parallel_sizes={sizes} applies to "
                         f"cp_comm_type='a2a+p2p', not {comm!r}")  # fmt: skip
    groups = kv_heads_per_rank(model, parallel.tensor_model_parallel_size)
    if groups % sizes[0]:
        raise ValueError(
            f"cp_comm_type='a2a+p2p' splits each tensor-parallel rank's {groups} of "
            f"num_query_groups={model.num_query_groups} (tensor_model_parallel_size="
            f"{parallel.tensor_model_parallel_size}) over the inner context-parallel size "
            f"{sizes[0]} (hierarchical_context_parallel_sizes={sizes}), which does not "
            "divide it"
        )
