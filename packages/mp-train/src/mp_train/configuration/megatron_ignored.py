"""The Megatron-LM flags mp accepts without effect, each with the reason: CUDA fusions and
implementations mp does not have or need, and settings whose result mp reaches another
way (megatron_flags.py adds them to the parser, warns when one is given, and
docs/migrating-from-megatron.md lists them for readers)."""

from __future__ import annotations

__all__ = ["IGNORED"]

# flag (dest) -> (takes a value, why mp needs nothing for it)
IGNORED: dict[str, tuple[bool, str]] = {
    "use_mcore_models": (False, "mp has one GPT implementation (megatron-core's module layout)"),
    "no_masked_softmax_fusion": (
        False,
        "a CUDA kernel fusion: mp's attention is SDPA or blocked "
        "matmuls, never the fused masked softmax",
    ),
    "no_gradient_accumulation_fusion": (
        False,
        "a CUDA kernel fusion: mp accumulates weight gradients with plain matmuls",
    ),
    "no_bias_swiglu_fusion": (False, "a CUDA kernel fusion: mp computes bias + SwiGLU unfused"),
    "no_bias_gelu_fusion": (False, "a CUDA kernel fusion: mp computes bias + GELU unfused"),
    "no_bias_dropout_fusion": (
        False,
        "a CUDA kernel fusion: mp computes bias + dropout + residual unfused",
    ),
    "no_rope_fusion": (False, "a CUDA kernel fusion: mp applies rotary embeddings unfused"),
    "defer_embedding_wgrad_compute": (
        False,
        "when to compute the output layer's weight gradient (Megatron-LM defers it to the "
        "pipeline flush to overlap it): mp computes the same product in the backward",
    ),
    "wgrad_deferral_limit": (
        True,
        "how many micro-batches --defer-embedding-wgrad-compute defers, which mp does not",
    ),
    "enable_experimental": (
        False,
        "unlocks Megatron-LM's experimental APIs; mp has no such lock (what it implements "
        "runs without a switch)",
    ),
    "is_hybrid_model": (
        False,
        "mp builds a hybrid model whenever --hybrid-layer-pattern is given (without it the "
        "flag names nothing to build)",
    ),
    "use_fused_weighted_squared_relu": (
        False,
        "a CUDA kernel fusion of the experts' squared ReLU and routing weight: mp computes "
        "them unfused",
    ),
    "no_persist_layer_norm": (
        False,
        "selects Apex's persistent LayerNorm kernel, which mp does not use",
    ),
    "attention_softmax_in_fp32": (
        False,
        "mp's attention softmax accumulates in fp32 already (SDPA kernels, torch.softmax)",
    ),
    "no_async_tensor_model_parallel_allreduce": (
        False,
        "a CUDA overlap switch; mp's tensor-parallel reductions are synchronous",
    ),
    "tp_only_amax_red": (
        False,
        "mp's FP8 scales each rank's tensors from their own amax, with no amax reduction",
    ),
    "fp8_interval": (True, "deprecated by Transformer Engine and ignored by Megatron too"),
    "use_cpu_initialization": (
        False,
        "mp draws weights on the CPU unless --use-device-initialization (the same model "
        "at every TP size either way)",
    ),
    "legacy_tokenizer": (False, "mp has one tokenizer implementation per --tokenizer-type"),
    "mmap_bin_files": (False, "mp always memory-maps .bin files"),
    "no_mmap_bin_files": (False, "mp always memory-maps .bin files"),
    "use_dist_ckpt": (False, "mp's checkpoints are always distributed (torch_dist-style)"),
    "ckpt_fully_parallel_save": (False, "every rank of mp writes its own pieces already"),
    "no_ckpt_fully_parallel_save": (False, "every rank of mp writes its own pieces"),
    "ckpt_fully_parallel_load": (False, "every rank of mp reads only the pieces it needs"),
    "ckpt_assume_constant_structure": (False, "a save-planning cache mp does not need"),
    "no_query_key_layer_scaling": (
        False,
        "the default: mp divides attention scores by the layer number only under "
        "--apply-query-key-layer-scaling",
    ),
    "trust_remote_code": (
        False,
        "mp's HuggingFaceTokenizer reads tokenizer.json with the tokenizers library and never "
        "runs code from a model repository",
    ),
    "export_force_local_attention": (
        False,
        "a ModelOpt switch choosing Megatron's local attention over Transformer Engine's; "
        "mp's attention is its own (--transformer-impl, --attention-backend)",
    ),
    "moe_shared_expert_overlap": (
        False,
        "overlaps the shared expert with the token dispatch on CUDA streams; mp runs them "
        "one after the other, with the same result",
    ),
    "cache_mla_latents": (
        False,
        "mp's KV cache always keeps multi-latent attention's latents (and attends in their space)",
    ),
    "moe_permute_fusion": (
        False,
        "fuses the MoE token permutation and its inverse into Transformer Engine kernels; mp "
        "permutes with torch's index operations, with the same result",
    ),
    "tiktoken_pattern": (
        True,
        "the split pattern of --tokenizer-type TikTokenizer, which mp does not have (that "
        "type is refused); Megatron-LM reads it for no other tokenizer either",
    ),
    "fsdp_double_buffer": (
        False,
        "double-buffers Megatron-FSDP's communication buffers (for NCCL user buffers); mp's "
        "FSDP is torch's FSDP2, which allocates and reuses its own",
    ),
    "use_nccl_ub": (
        False,
        "registers the data-parallel buffers as NCCL user buffers (fewer SMs for the "
        "collectives); mp's collectives use torch's buffers, with the same results",
    ),
    "auto_detect_ckpt_format": (
        False,
        "Megatron-LM tells its legacy and distributed formats apart on load; mp loads its "
        "own format only (a Megatron-LM checkpoint converts with `mp-ckpt import-megatron`), "
        "so there is nothing to detect",
    ),
    "use_persistent_ckpt_worker": (
        False,
        "Megatron-LM's --async-save needs its persistent writer (without it, it drops "
        "--async-save); mp's asynchronous save writes from a background thread of the "
        "training process, its host buffers kept from one save to the next",
    ),
    "async_strategy": (
        True,
        "chooses Megatron-LM's asynchronous writer (nvrx or mcore); mp has one (--async-save)",
    ),
    "dist_ckpt_optim_fully_reshardable": (
        False,
        "mp saves the optimizer state as logical tensors, like the weights: it loads under "
        "any TP, PP, EP and DP already (tests/test_checkpoint_reshard.py, "
        "test_train_moe_reshard.py)",
    ),
    "verify_integrity": (
        False,
        "mp records every checkpoint file's sha256 on save and checks it on every load already",
    ),
    "te_rng_tracker": (
        False,
        "selects Transformer Engine's random-state tracker (for CUDA graphs); mp's own "
        "tracker serves every random stream",
    ),
    "use_flashinfer_fused_rope": (
        False,
        "a FlashInfer kernel for rotary embeddings in inference; mp applies them unfused, "
        "with the same result",
    ),
    "moe_router_fusion": (
        False,
        "fuses the routing's top-k and auxiliary losses into Transformer Engine kernels; mp "
        "computes them with torch's operations, with the same result",
    ),
    "overlap_moe_expert_parallel_comm": (
        False,
        "overlaps the expert-parallel all-to-alls with another micro-batch's computation on "
        "CUDA streams; mp runs each micro-batch's one after the other, with the same result",
    ),
    "tp_comm_overlap": (
        False,
        "overlaps the tensor-parallel all-gathers and reduce-scatters with the GEMMs through "
        "Transformer Engine's userbuffers, which mp does not use; its collectives run before "
        "and after each GEMM, the same values (it still needs --sequence-parallel, as in "
        "Megatron-LM)",
    ),
    "tp_comm_overlap_cfg": (
        True,
        "configures Transformer Engine's userbuffers for --tp-comm-overlap, which mp does not use",
    ),
    "delay_wgrad_compute": (
        False,
        "in --overlap-moe-expert-parallel-comm's schedule, computes the weight gradients "
        "after the next micro-batch's all-to-all; mp computes every gradient in its own "
        "backward, the same values",
    ),
    "ep_overlap_early_attn_memory_release": (
        False,
        "in --overlap-moe-expert-parallel-comm's schedule, frees attention's activations "
        "earlier; mp keeps what autograd keeps, the same values",
    ),
    "overlap_dispatch_backward_with_experts_wgrad": (
        False,
        "overlaps the dispatch's backward all-to-all with the experts' weight gradients on "
        "CUDA streams; mp runs them one after the other, with the same result",
    ),
    "overlap_param_gather_with_optimizer_step": (
        False,
        "starts the first bucket's parameter all-gather inside the optimizer step; mp starts "
        "every gather after the step (under --overlap-param-gather they overlap the next "
        "forward), with the same result",
    ),
    "muon_use_syrk": (
        False,
        "computes Muon's Gram matrices with a Triton SYRK kernel (only the triangle); mp "
        "computes them with a matmul, the same matrices",
    ),
    "no_use_layer_wise_param_layout": (
        False,
        "picks how Megatron's layer-wise distributed optimizer lays its gradient buffers "
        "out; mp's (optimizer muon with the distributed optimizer) all-reduces DDP's own "
        "buffers and broadcasts whole parameters, the same update either way",
    ),
    "mla_down_proj_fusion": (
        False,
        "fuses MLA's query and key/value down projections (and the input norm) where the "
        "backend supports it; mp runs them as two linear layers, with the same result",
    ),
    "async_ckpt_use_cpu_shm": (
        False,
        "copies the tensors to CPU shared memory before Megatron's asynchronous checkpoint "
        "worker process takes them (no CUDA IPC handles across processes); mp's "
        "asynchronous save copies them to the training process's own host memory and "
        "writes them from a thread of that process, with no worker process to hand them to",
    ),
    "apply_residual_connection_post_layernorm": (
        False,
        "megatron-core reads it nowhere: its GPT and hybrid layers add the residual from "
        "before the norm whatever it says (only Megatron's removed legacy models read it); "
        "mp computes what megatron-core computes",
    ),
    "mlp_chunks_for_prefill": (
        True,
        "runs each MLP on pieces of a prompt in inference's prefill to lower its peak "
        "memory; mp's generation runs the MLP on the whole prompt, with the same result",
    ),
    "exit_signal_handler_for_dataloader": (
        False,
        "megatron-core 0.19.2 reads it nowhere (its loader workers follow "
        "--exit-signal-handler, as mp's do)",
    ),
    "record_shapes": (
        False,
        "records shapes in the NVTX ranges of Megatron-LM's Nsight Systems path (--profile "
        "without --use-pytorch-profiler), which mp does not have: its --profile is "
        "torch.profiler, whose shapes --pytorch-profiler-collect-shapes records",
    ),
    "nvtx_ranges": (
        False,
        "adds NVTX ranges around Megatron-LM's regions for Nsight Systems; mp emits none (its "
        "--profile is torch.profiler, with a range per iteration); training is the same",
    ),
    "moe_router_padding_for_quantization": (
        False,
        "pads each expert's tokens to a multiple of 16 or 32 for FP8/FP4 grouped GEMM "
        "kernels, the added tokens with routing weight 0 (the same output); mp's experts "
        "compute the tokens routed to them",
    ),
    "moe_router_padding_for_fp8": (
        False,
        "Megatron-LM's older name of --moe-router-padding-for-quantization, which pads "
        "tokens of routing weight 0 for FP8 grouped GEMM kernels (the same output)",
    ),
    "non_persistent_local_ckpt_dir": (
        True,
        "read only with --non-persistent-ckpt-type local, which mp refuses (global "
        "non-persistent checkpoints go to --non-persistent-global-ckpt-dir)",
    ),
    "non_persistent_local_ckpt_algo": (
        True,
        "read only with --non-persistent-ckpt-type local, which mp refuses",
    ),
    "mup_width_mult": (
        True,
        "Megatron-LM overwrites it with hidden_size / mup_base_hidden_size under --use-mup "
        "and reads it nowhere else; mp computes the same multiplier from those two",
    ),
}
