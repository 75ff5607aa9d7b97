"""The rules between the model's cp_comm_type and mp-state's hierarchical context
parallelism, and of Llama 4's chunked attention beside context parallelism and packed
documents (validate calls `check_hierarchical_context_parallel` and
`check_chunked_attention`)."""

from __future__ import annotations

from mp_layers import kv_heads_per_rank

__all__ = ["check_chunked_attention", "check_hierarchical_context_parallel"]


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


def check_chunked_attention(config) -> None:
    """Llama 4's chunked attention splits a sequence longer than attention_chunk_size into
    blocks on one rank; documents (packed samples) and context-parallel chunks would cut
    across them, which mp does not implement."""
    chunk, seq = config.model.attention_chunk_size, config.gpt.seq_length
    if chunk is None or seq <= chunk:
        return
    cp = config.parallel.context_parallel_size
    documents = config.data.batches_carry_documents
    if cp > 1 or documents:
        what = (f"context_parallel_size={cp}" if cp > 1 else
                "samples of several documents (--sft or --reset-attention-mask)")  # fmt: skip
        raise ValueError(
            f"attention_chunk_size={chunk} below seq_length={seq} with {what} is not "
            f"implemented: use seq_length <= {chunk}"
        )
