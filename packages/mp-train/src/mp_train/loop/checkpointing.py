"""What the loop saves and restores through mp-ckpt.

Pieces: every model chunk's sharded_state_dict (data-parallel ranks > 0 mark
theirs as replicas, so each logical piece is written once; under FSDP each
rank's pieces are the flattened ranges its shards hold, all written) and,
unless no_save_optim, the optimizer's. Common (rank 0): the iteration and consumed
samples, the scheduler, the optimizer's plain state, the run's configuration
(and the model's settings under Megatron's names, for `mp-ckpt export-hf`).

The rerun engine's state (loop/rerun.py), when it has some: a pending rerun in common
and in each rank's rank_state, the spiky-loss check's reference in rank_state.

Per rank (mp-ckpt's rank_state, one file per rank), unless no_save_rng: every
generator the rank draws from (python, numpy, torch's CPU and CUDA ones, and
the tracker's streams), keyed by the rank's position: its rank and size in
each group that decides a seed or a stream (tp, pp, dp, cp, ep, expert_tp)
and the virtual pipeline size. Megatron's rng_state holds the same states,
one entry per data-parallel rank of each (pp, tp) rank. A resume restores
them only when every rank finds its own position saved; otherwise (another
layout, another rank order, a checkpoint saved with no_save_rng or
converted) no rank does, a warning says why, and the generators keep what
this run's seeding gave them, as after no_load_rng.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import (
    CheckpointCorrupted,
    Checkpointer,
    CheckpointReader,
    ShardedTensor,
    is_hf_directory,
    list_iterations,
    load_checkpoint,
    read_metadata,
    read_tracker,
)
from mp_layers.moe import is_expert_key
from mp_train.loop.any_rank import any_rank
from mp_train.loop.hf_start import export_hf, load_hf_start
from mp_train.loop.setup import Run, TrainState
from mp_train.loop.starting_point import starting_point

__all__ = [
    "export_run_hf",
    "load_run_checkpoint",
    "model_only_loaded",
    "prepare_run_checkpointer",
    "run_pieces",
    "save_run_checkpoint",
]

log = logging.getLogger("mp_train")


def run_pieces(run: Run, *, with_optimizer: bool) -> dict[str, ShardedTensor]:
    """The pieces this rank saves (and loads into)."""
    pieces: dict[str, ShardedTensor] = {}
    for chunk in run.model:
        for key, p in chunk.sharded_state_dict().items():
            # Experts are replicated over the expert data-parallel ranks, the rest over the
            # data-parallel ones; a flattened range is a part of this rank's FSDP shard,
            # disjoint from the other data-parallel ranks'.
            dp = run.state.expert_dp if is_expert_key(key) else run.state.dp_cp
            replica = p.replica_id
            if p.flattened_range is None:
                replica = p.replica_id * dp.size + dp.rank
            pieces[key] = ShardedTensor(
                p.key, p.data, p.global_shape, p.global_offset, replica, p.flattened_range,
                p.local_shape,
            )  # fmt: skip
    if with_optimizer:
        pieces.update(run.optimizer.sharded_state_dict()["state"])
    return pieces


def prepare_run_checkpointer(run: Run, checkpointer: Checkpointer) -> None:
    """Lets an async checkpointer allocate its staging buffers now, not at the first save.
    (The optimizer's states are created here if no step made them yet: zeros, as the
    first step would create them.)"""
    if checkpointer.async_save:
        pieces, _ = _pieces_to_save(run)
        checkpointer.prepare(pieces)


def _pieces_to_save(run: Run) -> tuple[dict, dict | None]:
    """What a save writes: the pieces, and the optimizer's sharded state (or None)."""
    optimizer_state = None
    if not run.config.checkpoint.no_save_optim:
        optimizer_state = run.optimizer.sharded_state_dict()
    pieces = run_pieces(run, with_optimizer=False)
    if optimizer_state is not None:
        pieces.update(optimizer_state["state"])
    return pieces, optimizer_state


def save_run_checkpoint(run: Run, checkpointer: Checkpointer, *, persistent: bool = True) -> None:
    """Saves the run at its current iteration (collective). Not `persistent`: a
    non-persistent checkpoint, which the progress log does not count."""
    ckpt = run.config.checkpoint
    pieces, optimizer_state = _pieces_to_save(run)
    common = {
        "iteration": run.train.iteration,
        "train_state": dataclasses.asdict(run.train),
        "scheduler": run.scheduler.state_dict(),
        "optimizer": optimizer_state["common"] if optimizer_state is not None else None,
        **_model_common(run),
    }
    rank_state = None
    if not ckpt.no_save_rng:
        rank_state = {"position": _rng_position(run),
                      "rng_state": mp_state.get_rng_state(run.rng_tracker)}  # fmt: skip
    rerun_common, rerun_mine = (None, None) if run.rerun is None else run.rerun.saved_state()
    if rerun_common is not None:
        common["rerun"] = rerun_common
    if rerun_mine is not None:
        rank_state = (rank_state or {}) | {"rerun": {"position": _rng_position(run)} | rerun_mine}
    # An async save's line comes before its writer starts, whose commit line follows it.
    if checkpointer.async_save and persistent:
        _progress_saved(run, async_save=True)
    start = time.perf_counter()
    checkpointer.save(run.train.iteration, pieces, common=common, rank_state=rank_state,
                      layout=_layout(run))  # fmt: skip
    took = time.perf_counter() - start
    if not checkpointer.async_save and persistent:
        _progress_saved(run, async_save=False)
    if not run.is_first_rank:
        return
    what = "checkpoint" if persistent else "non-persistent checkpoint"
    if checkpointer.async_save:
        log.info("%s of iteration %d staged in %.3f s; writing it to %s in the background",
                 what, run.train.iteration, took, checkpointer.save_dir)  # fmt: skip
    else:
        log.info("saved %s of iteration %d to %s in %.3f s", what, run.train.iteration,
                 checkpointer.save_dir, took)  # fmt: skip


def _progress_saved(run: Run, async_save: bool) -> None:
    if run.progress is not None:
        tokens = run.train.consumed_train_samples * run.config.gpt.seq_length
        run.progress.saved(run.train.iteration, run.train.floating_point_operations_so_far,
                           tokens, async_save)  # fmt: skip


def _model_common(run: Run) -> dict:
    """What a save (and a Hugging Face export) records of the model beside its tensors:
    the run's configuration, the model's settings under Megatron's names, its family and
    the tokenizer files and generation settings it came with (import-hf's records)."""
    common = {"config": run.config.as_dict(), "model_config": model_settings(run)}
    if run.family is not None:
        common["family"] = run.family
    return common | run.hf_files


def _layout(run: Run) -> dict:
    """The parallel layout a checkpoint records (RNG states are restored only under it)."""
    return {
        "tensor_model_parallel_size": run.state.tp.size,
        "pipeline_model_parallel_size": run.state.pp.size,
        "virtual_pipeline_model_parallel_size": (
            run.config.parallel.virtual_pipeline_model_parallel_size
        ),
        "data_parallel_size": run.data_parallel_size,
    }


def _rng_position(run: Run) -> dict:
    """This rank's place in the layout, as far as its seeds and streams depend on it: the
    key its saved RNG states are restored under."""
    groups = {kind: getattr(run.state, kind) for kind in _RNG_GROUPS}
    return {
        **{kind: [group.rank, group.size] for kind, group in groups.items()},
        "virtual_pipeline_model_parallel_size": (
            run.config.parallel.virtual_pipeline_model_parallel_size
        ),
    }


_RNG_GROUPS = ("tp", "pp", "dp", "cp", "ep", "expert_tp")


# Model settings that change tensor shapes or names: a checkpoint made with other values
# cannot be resharded into this model.
_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "ffn_hidden_size", "activation", "normalization",
                 "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                 "untie_embeddings_and_output_weights", "position_embedding_type",
                 "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                 "qk_pos_emb_head_dim", "v_head_dim", "sublayer_norm",
                 "qk_layernorm_scope")  # fmt: skip


def _check_checkpoint_fits(run: Run, load: str, iteration: int | None, optimizer: bool) -> None:
    """Raises, listing every differing field, when the saved model has another shape, and
    when the `optimizer` state to load was not saved (no_save_optim, or an import without
    it)."""
    path = CheckpointReader(load, iteration=iteration).directory / "common.pt"
    if not path.exists():
        raise CheckpointCorrupted(f"{path.parent} failed its integrity check: {path}: missing")
    common = torch.load(path, weights_only=False)
    if optimizer and common.get("optimizer") is None:
        raise ValueError(f"{path.parent} holds no optimizer state (saved with no_save_optim): "
                         "load it with --no-load-optim or --finetune")  # fmt: skip
    saved = (common.get("config") or {}).get("model")
    if saved is None:
        return  # not saved by the training loop (an imported checkpoint): tensors decide
    now = run.config.as_dict()["model"]
    differing = [
        f"{name}: checkpoint {saved.get(name)!r}, this run {now.get(name)!r}"
        for name in _SHAPE_FIELDS
        if name in saved and saved.get(name) != now.get(name)
    ]
    saved_vocab = (common.get("model_config") or {}).get("vocab_size")
    if saved_vocab is not None and saved_vocab != run.padded_vocab_size:
        differing.append(
            f"padded vocabulary: checkpoint {saved_vocab}, this run {run.padded_vocab_size}"
        )
    if differing:
        raise ValueError(
            f"the checkpoint under {load} holds another model and cannot be resharded into "
            "this one:\n  " + "\n  ".join(differing)
        )


def _earlier_checkpoints(load: str, iteration: int) -> str:
    """The hint a corrupted checkpoint's error ends with: the complete checkpoint
    directories under `load` older than `iteration`, newest first, and how to resume
    from one."""
    older = [i for i in reversed(list_iterations(load)) if i < iteration]
    if not older:
        return f"; no earlier checkpoint under {load} to resume from"
    listed = ", ".join(map(str, older[:5])) + (" ..." if len(older) > 5 else "")
    return (f"; earlier checkpoints under {load}: iterations {listed}; resume from the newest "
            f"with --ckpt-step {older[0]} (it is checked the same way as it loads)")  # fmt: skip


def load_run_checkpoint(run: Run) -> str | None:
    """Loads the run's starting point (starting_point: `checkpoint.load`, else
    `checkpoint.pretrained_checkpoint`) into the run; returns the directory loaded, or
    None."""
    ckpt = run.config.checkpoint
    undrawn = run.config.training.no_initialization  # every model key must be loaded
    start = starting_point(ckpt)
    if start is None:
        if ckpt.load is not None and run.is_first_rank:  # Megatron-LM's warning
            log.warning("load=%s holds no checkpoint: training starts from scratch", ckpt.load)
        if undrawn:
            raise ValueError(
                f"--no-initialization: --load {ckpt.load} holds no checkpoint and no "
                "--pretrained-checkpoint is given; the weights would be uninitialized memory"
            )
        return None
    path, finetune = start
    if is_hf_directory(path):
        if ckpt.ckpt_step is not None:
            raise ValueError(f"ckpt_step={ckpt.ckpt_step} with the Hugging Face directory "
                             f"{path}: it holds one model, without iterations")  # fmt: skip
        pieces = run_pieces(run, with_optimizer=False)
        load_hf_start(run, path, pieces)
        model_only_loaded(run, pieces)
        log.info("loaded the Hugging Face model %s (fine-tuning from iteration 0)", path)
        return path
    with_optimizer = not (ckpt.no_load_optim or finetune)
    pieces = run_pieces(run, with_optimizer=with_optimizer)
    try:
        _check_checkpoint_fits(run, path, ckpt.ckpt_step, with_optimizer)
        # Without the optimizer (finetune, no_load_optim) a saved tensor the model does
        # not ask for is passed over, and one it asks for that is not saved still raises:
        # Megatron-LM's assume_ok_unexpected.
        lenient = ("raise", "ignore") if ckpt.strict_load and not with_optimizer else None
        loaded = load_checkpoint(
            path, pieces, iteration=ckpt.ckpt_step, finetune=finetune,
            strict=ckpt.strict_load, every_key_saved=undrawn,
            mismatch=ckpt.load_mismatch or lenient, unasked_optimizer=not with_optimizer,
        )  # fmt: skip
    except CheckpointCorrupted as error:
        iteration = ckpt.ckpt_step if ckpt.ckpt_step is not None else read_tracker(path)
        # The hint ends the first line, which a one-line report shows; any more problems
        # follow on their lines.
        first, *more = str(error).split("\n", 1)
        hint = _earlier_checkpoints(path, iteration)
        raise CheckpointCorrupted("\n".join([first + hint, *more])) from error
    common = loaded.common
    run.family = common.get("family")
    if _same_tokenizer(run, common):  # the files it came with still describe it
        run.hf_files = {k: common[k] for k in ("tokenizer", "generation_config") if k in common}
    if with_optimizer:
        for chunk in run.model:  # FSDP's pieces are copies of its shards
            chunk.restore_pieces(pieces)
        template = run.optimizer.sharded_state_dict()
        run.optimizer.load_sharded_state_dict(
            {"state": {k: pieces[k] for k in template["state"]}, "common": common["optimizer"]}
        )
    else:
        model_only_loaded(run, pieces)
    if not finetune:
        run.train = TrainState(**common["train_state"])
        if ckpt.override_ckpt_iteration is not None:
            _override_iteration(run, common, loaded.directory)
        if run.config.training.phase_transitions:
            _check_batch_kept(run, common, loaded.directory, "phase_transition_iterations")
        if with_optimizer:  # Megatron-LM loads the scheduler with the optimizer
            run.scheduler.load_state_dict(common["scheduler"])
        restored = not ckpt.no_load_rng and _restore_rng(run, loaded)
        if run.rerun is not None:
            _restore_rerun(run, loaded, rng_restored=restored)
    log.info("loaded %s (iteration %d)", loaded.directory, loaded.iteration)
    return path


def _override_iteration(run: Run, common: dict, directory) -> None:
    """override_ckpt_iteration: the run resumes as at that iteration, its data replayed
    from there (Megatron's rule: consumed samples = iteration x global batch size, which
    must be the checkpoint's)."""
    target = run.config.checkpoint.override_ckpt_iteration
    _check_batch_kept(run, common, directory, f"override_ckpt_iteration={target}")
    run.train.iteration = target
    # The global batch trained with (global_batch_size may be left to its default).
    run.train.consumed_train_samples = target * run.calculator.global_batch_size
    run.train.skipped_train_samples = 0
    if run.is_first_rank:
        log.info("override_ckpt_iteration: resuming as at iteration %d (%d samples consumed)",
                 target, run.train.consumed_train_samples)  # fmt: skip


def _check_batch_kept(run: Run, common: dict, directory, what: str) -> None:
    """`what` counts consumed samples in global batches: the checkpoint's must be the run's
    (as given, or what its counters show: samples consumed per iteration)."""
    saved = ((common.get("config") or {}).get("training") or {}).get("global_batch_size")
    counters = common.get("train_state") or {}
    if saved is None and counters.get("iteration"):
        saved = counters["consumed_train_samples"] / counters["iteration"]
    now = run.calculator.global_batch_size
    if saved is not None and saved != now:
        raise ValueError(
            f"{what}: {directory} was saved with global_batch_size={saved:g}, this run has "
            f"{now}; its consumed samples would be counted at the wrong batch size"
        )


_TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def _same_tokenizer(run: Run, common: dict) -> bool:
    """Whether the checkpoint was saved by a run with this run's tokenizer."""
    saved = (common.get("config") or {}).get("data")
    now = run.config.as_dict()["data"]
    return saved is not None and all(saved.get(k) == now.get(k) for k in _TOKENIZER_FIELDS)


def model_only_loaded(run: Run, pieces: dict[str, ShardedTensor]) -> None:
    """After the model's pieces were filled without the optimizer's: FSDP's shards take
    their pieces, and the optimizer's fp32 copies the loaded weights."""
    for chunk in run.model:  # FSDP's pieces are copies of its shards
        chunk.restore_pieces(pieces)
    for chunk in run.model:  # the model changed under the optimizer's fp32 copies
        chunk.start_param_sync(force_sync=True)
    _refresh_main_params(run)


def export_run_hf(run: Run) -> None:
    """Writes the run's model to `checkpoint.export_hf_dir` as a Hugging Face directory
    (collective; hf_start.export_hf)."""
    export_hf(run, run_pieces(run, with_optimizer=False), _model_common(run))


# Why a rank cannot take back RNG states: ordered, so that the largest code, reduced over
# the ranks, names the reason that applies to the run as a whole.
_RNG_FITS, _RNG_ELSEWHERE, _RNG_MISSING = 0, 1, 2


def _restore_rng(run: Run, loaded) -> bool:
    """Every rank takes back the RNG states saved at its position, or none does and rank 0
    warns (collective); whether they did."""
    saved = loaded.rank_state
    if saved is None or "position" not in saved:
        status = _RNG_MISSING
    elif saved["position"] != _rng_position(run):
        status = _RNG_ELSEWHERE
    else:
        status = _RNG_FITS
    flag = torch.tensor([float(status)])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    status = int(flag.item())
    if status == _RNG_FITS:
        mp_state.set_rng_state(saved["rng_state"], run.rng_tracker)
        return True
    if dist.get_rank() == 0:
        log.warning(
            "%s: RNG states not restored: %s; the generators keep this run's seeding "
            "(seed=%d), as with no_load_rng", loaded.directory,
            _rng_mismatch(run, read_metadata(loaded.directory), status),
            run.config.training.seed,
        )  # fmt: skip
    return False


def _restore_rerun(run: Run, loaded, rng_restored: bool) -> None:
    """The rerun engine's state (loop/rerun.py): a pending rerun of an iteration, which
    every rank must find saved at its own position (collective then), and the spike
    checks' references, kept where the rank's position is the same. `rng_restored`:
    whether the run took back the saved random states (the rerun draws the first run's
    numbers only then)."""
    pending = loaded.common.get("rerun")
    saved = (loaded.rank_state or {}).get("rerun")
    fits = saved is not None and saved.get("position") == _rng_position(run)
    if pending is not None:  # every rank's part, or none
        fits = not any_rank([not fits])[0]
    run.rerun.load_state(pending, saved if fits else None, rng_restored=rng_restored)


def _rng_mismatch(run: Run, metadata: dict, status: int) -> str:
    """Why the saved RNG states do not fit this run, in words."""
    saved, now = metadata.get("layout") or {}, _layout(run)
    differing = [f"{name}: checkpoint {saved.get(name)!r}, this run {now[name]!r}"
                 for name in now if name in saved and saved[name] != now[name]]  # fmt: skip
    if differing:
        return "saved under another layout (" + "; ".join(differing) + ")"
    if status == _RNG_MISSING:
        return (
            "some rank finds none in the checkpoint (saved with no_save_rng, converted, "
            "or saved before RNG states were keyed by position)"
        )
    return "saved with the ranks placed otherwise (another rank order)"


def _refresh_main_params(run: Run) -> None:
    """fp32 main parameters that are copies take the loaded model weights."""
    for shards in run.optimizer.shards.values():
        for shard in shards:
            if not shard.aliased:
                shard.main_param.data.copy_(shard.model_view)


def model_settings(run: Run) -> dict:
    """The model's settings under Megatron's names (read by mp-ckpt export-hf)."""
    model = run.config.model
    return {
        "num_layers": model.num_layers, "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups, "kv_channels": model.kv_channels,
        "ffn_hidden_size": model.ffn_hidden_size, "normalization": model.normalization,
        "activation": model.activation, "layernorm_epsilon": model.layernorm_epsilon,
        "position_embedding_type": model.position_embedding_type,
        "rotary_base": model.rotary_base, "add_bias_linear": model.add_bias_linear,
        "untie_embeddings_and_output_weights": model.untie_embeddings_and_output_weights,
        "vocab_size": run.padded_vocab_size, "seq_length": run.config.gpt.seq_length,
        "max_position_embeddings": run.config.gpt.max_position_embeddings
        or run.config.gpt.seq_length,
    }  # fmt: skip
