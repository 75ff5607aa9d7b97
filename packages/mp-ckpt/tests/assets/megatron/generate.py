"""Write the Megatron-LM training-checkpoint fixtures of mp-ckpt's importer tests.

Run in a Python 3.12 venv with megatron-core 0.19.2 (CPU torch is enough; no Transformer
Engine, no Apex), from anywhere:

    /tmp/mcore-data-venv/bin/python packages/mp-ckpt/tests/assets/megatron/generate.py [CASE ...]

For each case (all by default) it starts ``tp * pp * dp`` gloo processes, builds a tiny GPTModel
with megatron-core's *local* layer spec (a hybrid case: HybridModel, hybrid.py; its venv also
needs einops), wraps it in megatron's DistributedDataParallel and
optimizer (Adam, fp32), trains 2 steps on a fixed batch through megatron's
forward-backward schedule (1F1B over gloo for the PP case), calls Megatron-LM's own
``megatron.training.checkpointing.save_checkpoint`` and writes, next to this file:

    <case>/latest_checkpointed_iteration.txt      ("2")
    <case>/iter_0000002/...                        (the checkpoint as Megatron-LM writes it)

for each case of cases.py's CASES (see README.md)
    <case>/reference.pt                            (tokens, logits, losses, args, Adam state)

then reloads the checkpoint with ``load_checkpoint`` into a freshly initialised model and
optimizer and checks the logits and the recorded Adam state come back identical.

The CUDA-only calls megatron makes are replaced by CPU stand-ins in ``patches.py``.
The tests that use these files never import megatron.
"""

import os
import shutil
import socket
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cases import (  # noqa: E402
    CASES,
    ITERATIONS,
    MICRO_BATCH,
    NEXT_BATCH_SEED,
    NEXT_STEP,
    SEED,
    SEQ,
    VOCAB,
)
from record import (  # noqa: E402
    TRACKED,
    adam_state,
    full_logits,
    mtp_losses_of,
    mup_of,
    optimizer_layout,
    param_groups_of,
    plain_args,
)


def megatron_args(name, case):
    """Parse + validate a Megatron-LM command line and install it as megatron's global args."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training import arguments, global_vars

    tp, pp = case.tp, case.pp
    argv = [
        "pretrain_gpt.py",
        "--seq-length",
        str(SEQ),
        "--max-position-embeddings",
        str(SEQ),
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--global-batch-size",
        str(MICRO_BATCH * case.dp),
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "0",
        "--train-iters",
        "10",
        "--weight-decay",
        "0.01",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--adam-eps",
        "1e-8",
        "--clip-grad",
        "1.0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
        "--make-vocab-size-divisible-by",
        "64",
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--transformer-impl",
        "local",
        "--use-cpu-initialization",
        "--seed",
        str(SEED),
        "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion",
        "--save",
        name,
        "--load",
        name,
        "--ckpt-format",
        case.fmt,
        "--save-interval",
        str(ITERATIONS),
        # last, so that a case's flags override the common ones (the MLA cases' vocabulary)
        *case.model,
        *case.extra,
    ]
    if case.dist_opt:
        argv.append("--use-distributed-optimizer")
    if case.ep > 1:
        argv += ["--expert-model-parallel-size", str(case.ep)]
    saved = sys.argv
    sys.argv = argv
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = saved
    arguments.validate_args(args)
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    global_vars.set_global_variables(args, build_tokenizer=False)
    return args


def build(args, seed):
    """GPTModel (local spec; HybridModel for a hybrid, hybrid.py) + megatron DDP + optimizer +
    LR scheduler, all from ``args`` (under --use-mup the optimizer's parameter groups as
    Megatron-LM's training loop makes them)."""
    import dataclasses

    import torch
    from dsa import dsa_decoder_spec, install_dsa_standins
    from gdn import gdn_decoder_spec
    from hybrid import hybrid_module
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.optimizer import (
        OptimizerConfig,
        get_megatron_optimizer,
        get_mup_config_overrides,
    )
    from megatron.core.utils import get_model_config
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.training import (
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
        resolve_ddp_bucket_size,
        wrap_model_chunks_with_ddp,
    )
    from patches import cuda_as_cpu

    torch.manual_seed(seed)  # use_cpu_initialization draws the full weights from this generator
    config = core_transformer_config_from_args(args)
    if args.experimental_attention_variant == "dsa":  # DeepSeek sparse attention (dsa.py)
        install_dsa_standins()
        spec = dsa_decoder_spec(config, args.normalization)
    elif args.experimental_attention_variant:  # gated DeltaNet layers (gdn.py)
        spec = gdn_decoder_spec(config, args.normalization)
    elif args.num_experts:  # per-layer specs (MoE or dense), as pretrain_gpt.py builds them
        spec = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
        )
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization)
    # multi-token prediction: its layer shaped as the decoder's last (Megatron-LM's
    # mtp_block_spec), on the last pipeline stage
    mtp_spec = (
        get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        if args.mtp_num_layers
        else None
    )
    module = (
        hybrid_module(args, config)
        if args.hybrid_layer_pattern
        else GPTModel(
            config=config,
            transformer_layer_spec=spec,
            mtp_block_spec=mtp_spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling,  # as Megatron-LM's gpt_builder (no factor)
        )
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
    )
    # as Megatron-LM's get_model: the bucket size resolved (None without overlapped grad
    # reduction), no bucketing on pipeline stages after the first, and the distributed
    # optimizer's parameter layout computed before the DDP wrap
    ddp_config.bucket_size = resolve_ddp_bucket_size(
        ddp_config,
        ps.get_data_parallel_group(with_context_parallel=True),
        ddp_config.overlap_grad_reduce,
        sum(p.numel() for p in module.parameters()),
    )
    bucket_size = None if ps.get_pipeline_model_parallel_rank() > 0 else ddp_config.bucket_size
    if args.use_mup:
        # as Megatron-LM's setup_model_and_optimizer under --use-mup: the standard overrides
        # (no weight decay on 1-D parameters and biases) merged with megatron-core's μP ones
        # (per-parameter lr and Adam eps from the model's width multiplier)
        opt_config, config_overrides = get_megatron_optimizer_config(args)
        mup_overrides = get_mup_config_overrides(
            config=opt_config,
            mup_width_mult=get_model_config(module).mup_width_mult,
            optimizer_type=opt_config.optimizer,
        )
        if mup_overrides:
            config_overrides = {**(config_overrides or {}), **mup_overrides}
    else:
        opt_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
        opt_config = OptimizerConfig(**{k: v for k, v in vars(args).items() if k in opt_fields})
        config_overrides = None  # get_megatron_optimizer's default: the standard overrides
    with cuda_as_cpu():
        (model,) = wrap_model_chunks_with_ddp(
            [module], config, ddp_config, DP=DistributedDataParallel, bucket_sizes=[bucket_size]
        )
        optimizer = get_megatron_optimizer(opt_config, [model], config_overrides=config_overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    return model, optimizer, scheduler


def batch(args, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, args.vocab_size, (MICRO_BATCH, SEQ + 1), generator=g)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ).contiguous()
    # explicit causal mask (True = masked): with None megatron builds one on "cuda"
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens, position_ids, mask, labels


def train_step(args, model, optimizer, scheduler, data):
    """One Megatron-LM iteration: zero grads, forward with labels (mean token loss), backward,
    finalize grads (DP/TP reductions), optimizer step (clip + Adam), scheduler step."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from patches import cuda_as_cpu

    tokens, position_ids, mask, labels = data

    def forward_step(data_iterator, model):
        # first stages return hidden states, the last stage per-token losses
        output = model(tokens, position_ids, mask, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    # megatron's schedule: no pipelining at PP1, 1F1B (gloo send/recv) at PP>1; the 1F1B
    # schedule allocates its token counter with device="cuda"
    with cuda_as_cpu():
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
    loss = out[0]["lm loss"] if out else None
    with cuda_as_cpu():
        finalize_model_grads([model])
        ok, grad_norm, _ = optimizer.step()
    assert ok
    scheduler.step(increment=args.global_batch_size)
    return (None if loss is None else loss.item()), float(grad_norm)


def worker(rank, world, port, name):
    import torch

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    if "--hybrid-layer-pattern" in CASES[name].model:
        from hybrid import install_mamba_standins

        install_mamba_standins()  # before megatron-core imports mamba_ssm
    if {"--experimental-attention-variant", "--linear-num-key-heads"} & set(CASES[name].model):
        from gdn import install_fla_standins

        install_fla_standins()  # before megatron-core imports FLA
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import megatron.core
    import patches
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    case = CASES[name]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        expert_model_parallel_size=case.ep,
    )
    patches.patch_all()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    args = megatron_args(name, case)
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    model, optimizer, scheduler = build(args, SEED)
    if args.use_mup:  # what megatron-core derives from the μP flags (cases.py's MUP)
        mup = mup_of(model.module.config)
        if rank == 0:
            print(f"[{name}] mup {mup}", flush=True)
        assert (mup["width_mult"], mup["output_mult"], mup["softmax_scale"]) == (2.0, 0.5, 0.25)
    train_data = batch(args, seed=0)
    losses = []
    for _ in range(ITERATIONS):
        losses.append(train_step(args, model, optimizer, scheduler, train_data))
    args.consumed_train_samples = ITERATIONS * args.global_batch_size
    with patches.cuda_as_cpu():
        save_checkpoint(
            ITERATIONS, [model], optimizer, scheduler, num_floating_point_operations_so_far=0
        )
    torch.distributed.barrier()

    ref_data = batch(args, seed=7)
    logits, loss = full_logits(model, ref_data)
    mtp_losses = mtp_losses_of(model, ref_data) if args.mtp_num_layers else None
    state = adam_state(model, optimizer)
    lr_next = optimizer.param_groups[0]["lr"]
    groups = param_groups_of(model, optimizer) if args.use_mup else None
    layouts = [None] * world
    torch.distributed.all_gather_object(layouts, optimizer_layout(model, optimizer))
    sched_state = scheduler.state_dict()

    # reload into a differently initialised model + optimizer and compare (the model alone
    # where the checkpoint holds no optimizer state)
    model_only = args.no_save_optim
    args.no_load_optim, args.no_load_rng = model_only, args.no_save_rng
    model2, optimizer2, scheduler2 = build(args, SEED + 1)
    if case.dist_opt:
        if case.fmt == "torch":
            patches.patch_distopt_legacy_step()
        # a never-stepped torch Adam has no state; DistributedOptimizer.state_dict() (used while
        # loading) expects one, so materialise it with megatron's own helper first
        with patches.cuda_as_cpu():
            for o in getattr(optimizer2, "chained_optimizers", [optimizer2]):
                o._init_optimizer_states_with_dummy_values()
    # no_grad: with fp32 + distributed optimizer the main params are views of leaf params
    # and loading copies into them in place
    with patches.cuda_as_cpu(), torch.no_grad():
        iteration, _ = load_checkpoint([model2], optimizer2, scheduler2)
    logits2, _ = full_logits(model2, ref_data)
    state2 = adam_state(model2, optimizer2)
    d_logits = 0.0 if logits is None else (logits - logits2).abs().max().item()
    if model_only:
        state, d_state, lr2 = {}, 0.0, lr_next
    else:
        d_state = max(
            (state[n][k] - state2[n][k]).abs().max().item()
            for n in state
            for k in state[n]
            if k != "step"
        )
        lr2 = optimizer2.param_groups[0]["lr"]
    assert iteration == ITERATIONS, iteration
    # under μP the reloaded optimizer's groups (schedules, eps, members) equal the saved ones
    assert groups is None or param_groups_of(model2, optimizer2) == groups
    assert d_logits == 0.0 and d_state == 0.0 and lr2 == lr_next, (d_logits, d_state, lr2, lr_next)

    # merge what the ranks hold (PP: logits on the last stage, params spread over stages)
    everything = [None] * world
    torch.distributed.all_gather_object(
        everything, dict(logits=logits, loss=loss, adam=state, losses=losses)
    )
    logits = next(e["logits"] for e in everything if e["logits"] is not None)
    loss = next(e["loss"] for e in everything if e["loss"] is not None)
    state = {n: v for e in everything for n, v in e["adam"].items()}
    state = {n: state[n] for n in TRACKED if n in state}
    losses = [
        (next(e["losses"][i][0] for e in everything if e["losses"][i][0] is not None), losses[i][1])
        for i in range(ITERATIONS)
    ]

    next_step = one_more_step(args, model, optimizer, scheduler) if name in NEXT_STEP else None

    if rank == 0:
        tokens, position_ids, _, labels = ref_data
        ref = dict(
            tokens=tokens,
            position_ids=position_ids,
            labels=labels,
            logits=logits,
            loss=loss,
            args=plain_args(args),
            adam=adam_only(state),
            iteration=ITERATIONS,
            optimizer_step=next((v["step"] for v in state.values() if "step" in v), None),
            scheduler=sched_state,
            optimizer_layout_per_rank=layouts,
            lr_next=lr_next,
            train_losses=[step_loss for step_loss, _ in losses],
            train_grad_norms=[g for _, g in losses],
            megatron_core_version=str(megatron.core.__version__),
            torch_version=str(torch.__version__),  # plain str: loads with weights_only=True
            reload_check=dict(
                max_abs_logits_diff=d_logits,
                max_abs_adam_state_diff=d_state,
                lr_next_after_load=lr2,
            ),
        )
        if args.optimizer == "muon":  # the matrices' state, beside Adam's of the others
            ref["muon"] = muon_only(state)
        if next_step is not None:
            ref["next_step"] = next_step
        if groups is not None:  # μP: the optimizer's parameter groups and the model's values
            ref["param_groups"] = groups
            ref["mup"] = mup
        if mtp_losses is not None:
            ref["mtp_losses"] = mtp_losses
        torch.save(ref, os.path.join(name, "reference.pt"))
        print(
            f"[{name}] OK: losses {[round(x, 4) for x, _ in losses]}, lr_next {lr_next:.3e}, "
            f"reload max|dlogits| {d_logits} max|dstate| {d_state}",
            flush=True,
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def one_more_step(args, model, optimizer, scheduler):
    """Iteration 3 from the saved state on a known batch: {tokens, position_ids, labels,
    lr, loss, grad_norm, adam (the TRACKED params' state after it, as in reference.pt),
    and under Muon muon}."""
    import torch

    data = batch(args, seed=NEXT_BATCH_SEED)
    lr = optimizer.param_groups[0]["lr"]
    loss, grad_norm = train_step(args, model, optimizer, scheduler, data)
    state = adam_state(model, optimizer)
    everything = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everything, dict(loss=loss, adam=state))
    merged = {n: v for e in everything for n, v in e["adam"].items()}
    tokens, position_ids, _, labels = data
    return dict(
        tokens=tokens,
        position_ids=position_ids,
        labels=labels,
        lr=lr,
        loss=next(e["loss"] for e in everything if e["loss"] is not None),
        grad_norm=grad_norm,
        adam=adam_only({n: merged[n] for n in TRACKED if n in merged}),
        **({"muon": muon_only(merged)} if args.optimizer == "muon" else {}),
    )


def adam_only(state):
    """The tracked parameters Adam steps (all of them but under --optimizer muon)."""
    return {n: v for n, v in state.items() if "momentum_buffer" not in v}


def muon_only(state):
    """The tracked parameters Muon steps: {name: {param, momentum_buffer}}, TRACKED order."""
    return {n: state[n] for n in TRACKED if n in state and "momentum_buffer" in state[n]}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main():
    import torch.multiprocessing as mp

    cases = sys.argv[1:] or list(CASES)
    # relative paths: the args pickled into the checkpoints then name no directory of this machine
    os.chdir(HERE)
    for name in cases:
        world = CASES[name].world
        shutil.rmtree(name, ignore_errors=True)
        os.makedirs(name)
        os.environ["WORLD_SIZE"] = str(world)
        mp.spawn(worker, args=(world, free_port(), name), nprocs=world, join=True)


if __name__ == "__main__":
    main()
