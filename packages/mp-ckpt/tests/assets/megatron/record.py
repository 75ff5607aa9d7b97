"""What reference.pt records of a Megatron run, for generate.py: the tracked parameters'
Adam state as full global tensors (gathered over TP, layers numbered model-wide), how
Megatron lays out its optimizer state per rank, the full-vocabulary logits of the saved
model, and the args an importer needs as plain values. Run inside generate.py's
processes (megatron-core imported there)."""

# Parameters whose Adam state goes into reference.pt (those the model has).
TRACKED = [
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    "decoder.layers.0.input_layernorm.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.self_attention.linear_qkv.bias",
    "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.0.mlp.linear_fc1.weight",
    "decoder.layers.1.mlp.linear_fc2.weight",  # under PP2: stage 1's local layer 0
    "output_layer.weight",
    # MoE layer 0 (expert numbers are global: expert 3 lives on EP rank 1)
    "decoder.layers.0.mlp.router.weight",
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
    "decoder.layers.0.mlp.shared_experts.gate_weight",
    # the hybrid's (HybridModel, local spec names): its Mamba layer 0, attention layer 1
    "decoder.layers.0.mixer.in_proj.weight",
    "decoder.layers.0.mixer.conv1d_weight",
    "decoder.layers.0.mixer.A_log",
    "decoder.layers.0.mixer.out_proj.weight",
    "decoder.layers.0.norm.weight",
    "decoder.layers.1.self_attention.linear_qkv.weight",
    "decoder.final_norm.weight",
    # DeepSeek's sparse attention: layer 0's indexer query and layer 1's head weights
    "decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight",
    "decoder.layers.1.self_attention.core_attention.indexer.linear_weights_proj.weight",
    # the Qwen3-Next-shaped model's gated DeltaNet layer 0 (layer 1's linear_qkv: above)
    "decoder.layers.0.self_attention.in_proj.weight",
    "decoder.layers.0.self_attention.conv1d.weight",
    "decoder.layers.0.self_attention.A_log",
    "decoder.layers.0.self_attention.dt_bias",
    "decoder.layers.0.self_attention.out_norm.weight",
    "decoder.layers.0.self_attention.out_proj.weight",
    "decoder.layers.1.self_attention.q_layernorm.weight",
    # the DeepSeek-shaped model's: multi-latent attention, a routed expert, the MTP module
    "decoder.layers.0.self_attention.linear_q_down_proj.weight",
    "decoder.layers.0.self_attention.linear_q_proj.weight",
    "decoder.layers.0.self_attention.linear_kv_up_proj.weight",
    "decoder.layers.0.self_attention.kv_layernorm.weight",
    "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight",
    "mtp.layers.0.enorm.weight",
    "mtp.layers.0.eh_proj.weight",
    "mtp.layers.0.mtp_model_layer.self_attention.linear_kv_down_proj.weight",
    "mtp.layers.0.mtp_model_layer.mlp.router.weight",
    "mtp.layers.0.final_layernorm.weight",
]

# reference.pt["args"]: the Megatron args an importer needs, as plain values
ARG_NAMES = [
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "ffn_hidden_size",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "untie_embeddings_and_output_weights",
    "add_bias_linear",
    "add_qkv_bias",
    "vocab_size",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "max_position_embeddings",
    "seq_length",
    "micro_batch_size",
    "global_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "data_parallel_size",
    "use_distributed_optimizer",
    "ckpt_format",
    "lr",
    "min_lr",
    "lr_decay_style",
    "lr_warmup_iters",
    "train_iters",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "clip_grad",
    "params_dtype",
    "transformer_impl",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "expert_model_parallel_size",
    "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "qk_layernorm",
    "rope_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "mtp_num_layers",
    "mtp_loss_scaling_factor",
    "rotary_interleaved",
    "use_rope_scaling",
    "rope_scaling_factor",
    "no_rope_freq",
    "qk_l2_norm",
    "moe_apply_probs_on_input",
    "init_method_std",
]


def mamba_parts(name):
    """The rows of each part of a Mamba mixer's fused tensor `name` on one TP rank
    ([z; x; B; C; dt] for in_proj, [x; B; C] for conv1d), or a gated DeltaNet's ([query;
    key; value; z; beta; alpha], [query; key; value]), or None for another tensor."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    fused = name and ("in_proj.weight" in name or "conv1d" in name)
    args, tp = get_args(), ps.get_tensor_model_parallel_world_size()
    if fused and ".self_attention." in name and args.experimental_attention_variant:
        keys = args.linear_num_key_heads * args.linear_key_head_dim // tp
        values = args.linear_num_value_heads * args.linear_value_head_dim // tp
        heads = args.linear_num_value_heads // tp
        return ([keys, keys, values, values, heads, heads] if "in_proj" in name
                else [keys, keys, values])  # fmt: skip
    if not fused or ".mixer." not in name:
        return None
    head_dim = args.mamba_head_dim
    heads = args.mamba_num_heads or 2 * args.hidden_size // head_dim
    inner, states = heads * head_dim // tp, args.mamba_num_groups * args.mamba_state_dim // tp
    return (
        [inner, inner, states, states, heads // tp]
        if "in_proj" in name
        else [inner, states, states]
    )


def tp_gather(t, param, name=None):
    """Full tensor from this rank's TP shard of ``param`` (layout of a TP1 model; a Mamba
    mixer's in_proj or conv1d, `name`, regrouped part by part)."""
    import torch
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(
        parts, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group()
    )
    rows = mamba_parts(name)
    if rows is not None:  # each rank [z_r; x_r; B_r; C_r; dt_r]: the parts joined over ranks
        split = [p.view(-1, *param.shape[1:]).split(rows) for p in parts]
        joined = [torch.cat([s[j] for s in split]) for j in range(len(rows))]
        return torch.cat(joined).view(-1) if t.dim() == 1 else torch.cat(joined)
    if getattr(param, "partition_stride", 1) == 2:
        # SwiGLU fc1: each rank holds [gate_r; up_r]; a TP1 model holds [gate; up]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=param.partition_dim)


def global_name(name):
    """Model-global parameter name: under PP every stage numbers its layers from 0, under
    EP every rank its experts."""
    import re

    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    per_stage = get_args_num_layers() // ps.get_pipeline_model_parallel_world_size()
    i, rest = name[len(prefix) :].split(".", 1)
    expert = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.+)$", rest)
    if expert:
        local = get_args().num_experts // ps.get_expert_model_parallel_world_size()
        index = int(expert.group(1)) + ps.get_expert_model_parallel_rank() * local
        rest = f"mlp.experts.local_experts.{index}.{expert.group(2)}"
    return f"{prefix}{int(i) + ps.get_pipeline_model_parallel_rank() * per_stage}.{rest}"


def get_args_num_layers():
    from megatron.training import get_args

    return get_args().num_layers


def adam_state(model, optimizer):
    """{name: {param, exp_avg, exp_avg_sq, step}} for TRACKED params, as full global tensors
    (collective: every rank of the run calls it); a parameter Muon steps (--optimizer
    muon): {param, momentum_buffer}."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    named = {global_name(n): p for n, p in model.module.named_parameters()}
    out = {}
    for name in TRACKED:
        if name not in named:
            continue
        p = named[name]
        for opt in inner:
            if isinstance(opt, DistributedOptimizer):
                if not any(p in b.param_index_map for b in opt.buffers):
                    continue
                local = dp_gather(opt, p)
            else:
                if p not in opt.optimizer.state:
                    continue
                st = opt.optimizer.state[p]
                states = (
                    ("momentum_buffer",) if "momentum_buffer" in st else ("exp_avg", "exp_avg_sq")
                )
                local = {"param": p.detach(), **{k: st[k] for k in states}}
            out[name] = {k: tp_gather(v, p, name) for k, v in local.items()}
            first = opt.optimizer.state[opt.optimizer.param_groups[0]["params"][0]]
            if "step" in first:  # Adam's (Muon keeps no step count)
                out[name]["step"] = int(first["step"])
    return out


def dp_gather(opt, p):
    """The distributed optimizer's state of ``p`` (TP-local shape), put together from the
    pieces the data-parallel ranks own: each rank writes its piece into zeros and a sum over
    the DP group adds the others' (x + 0 = x, so exact)."""
    import torch

    full = {k: torch.zeros(p.numel()) for k in ("param", "exp_avg", "exp_avg_sq")}
    where = opt.model_param_gbuf_map.get(p)
    if where is not None:
        gbuf, dtype, bucket = where
        piece = opt.gbuf_ranges[gbuf][dtype][bucket]["param_map"][p]["param"]
        states = opt._get_main_param_and_optimizer_states(p)
        for k in full:
            full[k][piece.start : piece.end] = states[k].detach().view(-1)
    group = opt.data_parallel_group
    if group.size() > 1:
        for k in full:
            torch.distributed.all_reduce(full[k], group=group)
    return {k: v.view(p.shape) for k, v in full.items()}


def optimizer_layout(model, optimizer):
    """How Megatron lays out this rank's optimizer state, by parameter name.

    ``param_order``: names in the order of the torch optimizer's ``state_dict`` indices
    (legacy ``optimizer.state.<i>`` / ``param_groups[g].params``), without the distributed
    optimizer.  ``grad_buffer``: with the distributed optimizer, ``name -> (start, end,
    bucket_id)`` in the flat fp32 grad/param buffer that the checkpoint's
    ``...bucket_idx_<b>.{param,exp_avg,exp_avg_sq}`` tensors follow, plus its bucket sizes.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    names = {p: n for n, p in model.module.named_parameters()}
    out = {}
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if not any(isinstance(o, DistributedOptimizer) for o in inner):
        out["param_order"] = [
            names[p] for o in inner for g in o.optimizer.param_groups for p in g["params"]
        ]
        out["param_groups"] = [
            [names[p] for p in g["params"]] for o in inner for g in o.optimizer.param_groups
        ]
    else:
        out["grad_buffer"] = [
            {
                "param_index_map": {
                    names[p]: tuple(int(x) for x in r) for p, r in buf.param_index_map.items()
                },
                "bucket_indices": [tuple(int(x) for x in b) for b in buf.bucket_indices],
                "numel": int(buf.numel),
                "numel_unpadded": int(buf.numel_unpadded),
            }
            for buf in model.buffers
        ]
    return out


def param_groups_of(model, optimizer):
    """Every optimizer parameter group of this rank (the chained optimizers' in order) as
    plain values: its schedule (max_lr, min_lr, the current lr), Adam eps (where the group
    has one), wd_mult, lr_mult, weight_decay, default_config, and the sorted names of its
    parameters (``model.module.named_parameters()`` names, local to the rank)."""
    names = {p: n for n, p in model.module.named_parameters()}
    out = []
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for g in o.optimizer.param_groups:
            group = {
                k: float(g[k]) for k in ("max_lr", "min_lr", "lr", "wd_mult", "lr_mult",
                                         "weight_decay")
            }  # fmt: skip
            if "eps" in g:
                group["eps"] = float(g["eps"])
            group["default_config"] = bool(g["default_config"])
            group["names"] = sorted(names[p] for p in g["params"])
            out.append(group)
    return out


def mup_of(config):
    """The μP values megatron-core computed into the model's TransformerConfig."""
    return dict(
        width_mult=float(config.mup_width_mult),
        output_mult=float(config.mup_output_mult),
        embedding_mult=float(config.mup_embedding_mult),
        softmax_scale=float(config.softmax_scale),
    )


def full_logits(model, data):
    import torch
    from megatron.core import parallel_state as ps

    tokens, position_ids, mask, labels = data
    model.eval()
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            batch, seq = tokens.shape
            hidden = torch.empty(seq, batch, model.module.config.hidden_size)
            torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.module.set_input_tensor(hidden)
        local = model(tokens, position_ids, mask)
        if not ps.is_pipeline_last_stage():
            torch.distributed.send(
                local.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank()
            )
            model.train()
            return None, None
        if not ps.is_pipeline_first_stage():
            model.module.set_input_tensor(hidden)
        loss = model(tokens, position_ids, mask, labels=labels)
    model.train()
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        torch.distributed.all_gather(
            parts, local.contiguous(), group=ps.get_tensor_model_parallel_group()
        )
        local = torch.cat(parts, dim=-1)
    return local.float(), loss.float()


# names whose Megatron args attribute differs from the command-line flag
ARG_ALIASES = {"norm_epsilon": "layernorm_epsilon"}


def plain_args(args):
    missing = [k for k in ARG_NAMES if not hasattr(args, ARG_ALIASES.get(k, k))]
    assert not missing, missing
    out = {k: plain(getattr(args, ARG_ALIASES.get(k, k))) for k in ARG_NAMES}
    out["layernorm_epsilon"] = out["norm_epsilon"]
    # without --group-query-attention Megatron leaves num_query_groups at 1 and uses one
    # KV head per attention head; spell out the count the model really has
    out["num_kv_heads"] = (
        args.num_query_groups if args.group_query_attention else args.num_attention_heads
    )
    return out


def plain(v):
    import torch

    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    return v


def mtp_losses_of(model, data):
    """Each multi-token prediction module's loss on ``data`` (its masked mean token loss,
    as Megatron logs it: MTPLossLoggingHelper), from a training-mode forward with labels
    (no dropout here; nothing is stepped). One pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    assert ps.get_pipeline_model_parallel_world_size() == 1
    tokens, position_ids, mask, labels = data
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    model.train()
    model(tokens, position_ids, mask, labels=labels)
    losses = MTPLossLoggingHelper.tracker["loss_values"].detach().clone().float()
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    model.zero_grad_buffer()
    return losses
