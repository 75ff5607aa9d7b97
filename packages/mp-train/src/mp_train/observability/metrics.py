"""The loop's logs: a line every log_interval on the last rank, TensorBoard (Megatron's
tags, mp_train.observability.tensorboard), memory, MFU.

Each line: iteration, consumed samples, ms per iteration, learning rate,
global batch, the reported losses, loss scale, gradient norm, optional
parameter norm, skipped and nan iterations, tokens/s, TFLOP/s per rank and
MFU, current and peak memory; with log_straggler a second line, each rank's forward-step
time across ranks (mp_train.observability.stragglers). As Megatron's line, it describes
the iterations since the previous one: their time without the evaluations and saves
between them (the first from the start of training), the losses averaged over the steps
taken, the skipped and nan iterations among them. At start the theoretical memory and FLOPs
(mp_train.estimate) are printed; after the first logged iterations the
measured peak memory stands beside them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from mp_optim import counted_in_grad_norm, is_expert_parallel
from mp_train.estimate import estimate
from mp_train.loop.dsa_step import indexer_loss_names
from mp_train.loop.moe_step import PER_LAYER_PREFIX, aux_loss_names
from mp_train.loop.mtp_step import mtp_loss_names
from mp_train.loop.setup import Run
from mp_train.observability.memory import (
    device_memory_used,
    dump_memory_snapshot,
    memory_bytes,
    memory_mb,
)
from mp_train.observability.stragglers import STRAGGLER_TIMER, straggler_line
from mp_train.observability.tensorboard import TensorBoard

__all__ = [
    "MetricsLogger",
    "cpu_peak_tflops",
    "known_peak_tflops",
    "logged_lr",
    "measure_peak_tflops",
    "model_flops_utilization",
]

log = logging.getLogger("mp_train")

_GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
"""Dense bf16 peak TFLOP/s by device name (a substring of torch's device name)."""


def measure_peak_tflops(
    n: int = 1024,
    repeats: int = 5,
    dtype: torch.dtype = torch.bfloat16,
    rounds: int = 3,
    device: torch.device | str = "cpu",
) -> float:
    """An n x n matmul's best TFLOP/s on `device`: the fastest of `rounds` rounds of
    `repeats` calls, the rounds 10 ms apart, so that other processes busy at one moment
    lower it less."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    a @ b
    sync()
    best = math.inf
    for round_ in range(rounds):
        if round_:
            time.sleep(0.01)
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            sync()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def cpu_peak_tflops(n: int = 1024) -> float:
    """The MFU reference without a GPU: the faster of an n x n matmul in bf16 and in fp32
    (measure_peak_tflops). A CPU without native bf16 (AVX2 only) computes bf16 matmuls a
    hundred times slower than fp32 ones, and its 1024 x 1024 bf16 measure alone would take
    seconds: a 256 x 256 bf16 probe finds such a CPU, and the full bf16 measure is left
    out."""
    fp32 = measure_peak_tflops(n, dtype=torch.float32)
    if measure_peak_tflops(256, repeats=1, rounds=1) < fp32 / 4:
        return fp32
    return max(fp32, measure_peak_tflops(n))


def model_flops_utilization(
    tflops: float, reference: float, remeasure: Callable[[], float] | None
) -> tuple[float | None, float]:
    """(MFU, the reference it is against) of `tflops` achieved per rank. Above 1 the
    reference is wrong, not the run: a measured one (remeasure given) was taken while
    the machine was busy, and is measured again and raised; if the MFU is still above
    1, or the reference was given (--peak-tflops), there is no MFU to show (None)."""
    if tflops > reference and remeasure is not None:
        reference = max(reference, remeasure())
    if tflops > reference:
        return None, reference
    return tflops / reference, reference


class MetricsLogger:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.config = run.config.logging
        wandb_run = None
        if run.is_last_rank and self.config.wandb_project:
            try:
                import wandb
            except ImportError:
                self.print("wandb_project is set but wandb is not installed: not logging to it")
            else:
                wandb_run = wandb.init(project=self.config.wandb_project,
                                       name=self.config.wandb_exp_name,
                                       entity=self.config.wandb_entity,
                                       dir=self.config.wandb_save_dir,
                                       config=run.config.as_dict())  # fmt: skip
        self.board = TensorBoard(self.config, run.is_last_rank, wandb_run)
        model = run.config.model
        self._aux_names = set(aux_loss_names(model) + mtp_loss_names(model)
                              + indexer_loss_names(model))  # fmt: skip
        self.estimate = estimate(run.config, dist.get_world_size(),
                                 vocab_size=run.padded_vocab_size,
                                 device_type=run.device.type)  # fmt: skip
        self.peak_tflops = self.config.peak_tflops or known_peak_tflops(run.device)
        self._remeasure = None  # a measured reference is measured again if MFU passes 1
        if not self.peak_tflops:
            self.peak_tflops = _measured_peak(run.device)
            self._remeasure = functools.partial(_measured_peak, run.device)
        self._mfu_warned = False
        self._compile_reported = False
        self._interval_start = time.perf_counter()
        self._iteration_start = time.perf_counter()
        self._metrics_file = None
        if run.is_last_rank and self.config.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.config.metrics_file)), exist_ok=True)
            self._metrics_file = open(self.config.metrics_file, "a+")  # noqa: SIM115
            if self._metrics_file.tell() > 0:
                self._metrics_file.seek(self._metrics_file.tell() - 1)
                if self._metrics_file.read(1) != "\n":  # a line cut by a killed run
                    self._metrics_file.write("\n")
        self._sums: dict[str, float] = {}  # the reported values of the steps taken
        self._count = 0  # iterations since the last line
        self._advanced = 0  # of which their optimizer step was taken
        self._counted = (0, 0)  # the run's skipped and nan iterations at the last line
        self._tokens = 0
        self._flops = 0.0

    def print(self, message: str) -> None:
        if self.run.is_last_rank:
            print(message, flush=True)

    def print_start(self) -> None:
        e, run = self.estimate, self.run
        state = run.state
        experts = ""
        if run.config.model.num_moe_experts is not None:
            experts = (
                f" (experts: ep {state.ep.size} x expert tp {state.expert_tp.size} x expert dp "
                f"{state.expert_dp.size}; {e['num_active_parameters']:,} parameters active)"
            )
        self.print(
            f"mp-train: world {dist.get_world_size()} = tp {state.tp.size} x cp "
            f"{state.cp.size} x pp {state.pp.size} x dp {run.data_parallel_size}{experts}; "
            f"{e['num_parameters']:,} "
            f"parameters; theoretical memory of the most loaded rank: weights and optimizer "
            f"{e['weight_and_optimizer_mb']:.1f} MB, activations {e['activation_mb']:.1f} MB, "
            f"total {e['total_mb']:.1f} MB; {e['flops_per_iteration'] / 1e12:.3f} TFLOP per "
            f"iteration; MFU reference {self.peak_tflops:.3g} TFLOP/s per rank"
        )

    def training_started(self) -> None:
        """Starts the first log line's interval: the set-up before it (the datasets, a
        checkpoint load) is not in its time, as Megatron starts its interval timer when
        training starts."""
        self._interval_start = time.perf_counter()
        self._counted = (self.run.train.skipped_iterations, self.run.train.nan_iterations)

    def iteration_started(self) -> None:
        self._iteration_start = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leaves what runs inside (an evaluation, a save) out of the time of the log
        line's interval (ms/iteration, tokens/s, TFLOP/s, MFU, TensorBoard's
        iteration-time), as Megatron stops its interval timer around them."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._interval_start += time.perf_counter() - start

    def iteration_finished(self, losses, result, global_batch: int, microbatches: int) -> None:
        run = self.run
        seconds = time.perf_counter() - self._iteration_start
        iteration, consumed = run.train.iteration, run.train.consumed_train_samples
        lr = logged_lr(run.optimizer.param_groups)
        loss_scale = float(run.optimizer.get_loss_scale())
        grad_norm = result.grad_norm if result is not None else None
        # each separately clipped group's own norm (mtp_detach_heads: "mtp grad norm")
        by_group = (result.grad_norms_by_group if result is not None else None) or {}
        skipped = result is None or not result.update_successful
        if not skipped:  # as Megatron's: the printed averages are the steps taken
            self._advanced += 1
            for name, value in losses.items():
                if not name.startswith(PER_LAYER_PREFIX):  # per-layer values: not printed
                    self._sums[name] = self._sums.get(name, 0.0) + value
        if self._metrics_file is not None:
            record = {
                "iteration": iteration, "consumed_samples": consumed,
                "global_batch_size": global_batch, "lr": lr, "loss_scale": loss_scale,
                "grad_norm": grad_norm, "skipped": skipped,
                **{f"{group}_grad_norm": norm for group, norm in by_group.items()}, **losses,
            }  # fmt: skip
            self._metrics_file.write(json.dumps(record) + "\n")
            self._metrics_file.flush()
        self._count += 1
        self._tokens += global_batch * run.config.gpt.seq_length
        flops = self.estimate["flops_per_iteration"] * global_batch / self.estimate[
            "global_batch_size"]  # fmt: skip
        self._flops += flops
        run.train.floating_point_operations_so_far += flops
        printing = iteration % self.config.log_interval == 0
        boarding = self.board.writes_iteration(iteration)
        params_norm = None
        if self.config.log_params_norm and (printing or boarding):
            params_norm = parameters_norm(run)  # collective: every rank decides alike
        # MoE auxiliary losses (and with moe_per_layer_logging each layer's), the MTP and
        # indexer losses every iteration, without a vs-samples series (Megatron's
        # trackers); the rest every tensorboard_log_interval.
        every = {k: v for k, v in losses.items()
                 if k in self._aux_names or k.startswith(PER_LAYER_PREFIX)}  # fmt: skip
        self.board.add(iteration, every)
        if boarding:
            values = {k: v for k, v in losses.items() if k not in every}
            if self.config.log_learning_rate_to_tensorboard:
                values = {"learning-rate": lr, **values}
            if self.config.log_batch_size_to_tensorboard:
                values["batch-size"] = global_batch
            if self.config.log_loss_scale_to_tensorboard:
                values["loss-scale"] = loss_scale
            if self.config.log_world_size_to_tensorboard:
                values["world-size"] = dist.get_world_size()
            if grad_norm is not None:
                values["grad-norm"] = grad_norm
            values |= {f"{group}-grad-norm": norm for group, norm in by_group.items()}
            if result is not None and result.num_zeros_in_grad is not None:
                values["num-zeros"] = result.num_zeros_in_grad
            if params_norm is not None:
                values["params-norm"] = params_norm
            self.board.add(iteration, values, consumed)
            if self.config.log_memory_to_tensorboard:
                self.board.add(iteration, memory_bytes(run.device))
        if printing:
            self._print_interval(lr, loss_scale, result, global_batch, params_norm)
            if self.config.record_memory_history and run.is_last_rank:
                dump_memory_snapshot(self.config.memory_snapshot_path)
        if run.compiled_layers and not self._compile_reported:
            self._compile_reported = True
            self._print_compile_time(seconds)

    def _print_compile_time(self, seconds: float) -> None:
        """torch_compile compiles the layers in this process's first iteration."""
        run = self.run
        count = run.compiled_layers
        layers = f"{count} transformer layer" + ("s" if count > 1 else "")
        where = " of the last pipeline stage" if run.state.pp.size > 1 else ""
        self.print(
            f"compiled {layers}{where} (torch_compile): "
            f"first iteration {seconds:.1f} s, compilation included"
        )

    def _print_interval(self, lr, loss_scale, result, global_batch, params_norm) -> None:
        """The log line (and timing line) of the iterations since the previous one; with
        log_timers_to_tensorboard their times to TensorBoard (collective: the timers)."""
        run, iteration = self.run, self.run.train.iteration
        elapsed = time.perf_counter() - self._interval_start
        per_iteration_ms = 1000.0 * elapsed / self._count
        values = {
            "lr": lr,
            "global batch": global_batch,
            **{name: total / self._advanced for name, total in self._sums.items()},
            "loss scale": loss_scale,
        }
        if result is not None and result.grad_norm is not None:
            values["grad norm"] = result.grad_norm
        for group, norm in ((result.grad_norms_by_group if result else None) or {}).items():
            values[f"{group} grad norm"] = norm
        if result is not None and result.num_zeros_in_grad is not None:
            values["zeros in grad"] = result.num_zeros_in_grad
        if params_norm is not None:
            values["params norm"] = params_norm
        # Those of the interval, as Megatron's "number of skipped iterations" (and nan).
        counted = (run.train.skipped_iterations, run.train.nan_iterations)
        values["skipped iterations"] = counted[0] - self._counted[0]
        values["nan iterations"] = counted[1] - self._counted[1]
        self._counted = counted
        tflops = self._flops / elapsed / dist.get_world_size() / 1e12
        if self.config.log_throughput:
            values["tokens/s"] = self._tokens / elapsed
            values["TFLOP/s per rank"] = tflops
            mfu, self.peak_tflops = model_flops_utilization(
                tflops, self.peak_tflops, self._remeasure
            )
            if mfu is not None:
                values["MFU"] = mfu
            elif not self._mfu_warned:
                self._mfu_warned = True
                self.print(
                    f"MFU not shown: {tflops:.3g} TFLOP/s per rank exceed the reference "
                    f"{self.peak_tflops:.3g} TFLOP/s"
                    + ("" if self.config.peak_tflops else " (measured twice)")
                    + "; give the device's peak with --peak-tflops"
                )
        if self.config.log_memory:
            values.update(memory_mb(run.device))
        if self.config.log_device_memory_used:
            values["device memory used MB"] = device_memory_used(run.device) / 2**20
        line = (
            f"iteration {iteration:>8} | consumed samples {run.train.consumed_train_samples:>10} "
            f"| ms/iteration {per_iteration_ms:.1f} | "
            + " | ".join(f"{k} {_fmt(v)}" for k, v in values.items())
        )
        names = ["forward-backward", "optimizer"]
        if self.config.log_straggler:
            names.append(STRAGGLER_TIMER)  # one gather for the timers and the stragglers
        times = run.timers.gather(names, normalizer=self._count)
        forward_steps = times.pop(STRAGGLER_TIMER, None)
        timing = run.timers.format(times)
        self.print(line if self.config.timing_log_level == 0 else f"{line}\n{timing}")
        if forward_steps is not None:
            self.print(straggler_line(forward_steps, self.config.straggler_minmax_count))
        every = self.config.log_memory_interval
        if self.config.log_memory and (iteration == self.config.log_interval
                                       or (every and iteration % every == 0)):  # fmt: skip
            self.print(
                f"memory after {iteration} iterations: peak {values.get('peak memory MB', 0):.1f} "
                f"MB measured, {self.estimate['total_mb']:.1f} MB theoretical (weights, "
                "optimizer, activations; the process's own overhead is not in it)"
            )
        if self.config.log_timers_to_tensorboard:
            # Megatron's: seconds per iteration over the interval, timers at their max rank.
            timed = {"iteration-time": elapsed / self._count}
            if self.config.log_throughput:
                timed["throughput"] = tflops
            timed.update({f"{name}-time": max(ms) / 1000.0 for name, ms in times.items()})
            self.board.add(iteration, timed)
        self._interval_start = time.perf_counter()
        self._sums, self._count, self._advanced, self._tokens, self._flops = {}, 0, 0, 0, 0.0

    def evaluation(self, results: dict[str, float], final: bool, suffix: str = "",
                   test: bool = False) -> None:  # fmt: skip
        """The evaluation's line and TensorBoard values; suffix: one validation set's
        ("-<name>", multiple_validation_sets); test: the test split's, at the end."""
        iteration = self.run.train.iteration
        parts = []
        for name, value in results.items():
            parts.append(f"{name} {value:.6g}")
            if "loss" in name and math.isfinite(value) and value < 50:
                parts.append(f"{name} PPL {math.exp(value):.6g}")
        label = (f"test at iteration {iteration}" if test
                 else f"final validation{suffix}" if final
                 else f"validation{suffix} at iteration {iteration}")  # fmt: skip
        self.print(f"{label} | " + " | ".join(parts))
        # As Megatron: an evaluation-only run (skip_train) writes nothing to TensorBoard.
        if not self.run.config.training.skip_train:
            self.board.validation(results, iteration, self.run.train.consumed_train_samples,
                                  suffix, split="test" if test else "validation")  # fmt: skip

    def close(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
        self.board.close()
        if self.board.wandb is not None:
            self.board.wandb.finish()


def logged_lr(param_groups: list[dict]) -> float:
    """The learning rate the log shows: the first group's that follows lr (not a
    decoupled learning rate's or a muP-scaled group, as Megatron logs its default-schedule
    group's)."""
    followers = [g for g in param_groups if not (g.get("decoupled_lr") or g.get("mup"))]
    followers = followers or param_groups
    return followers[0]["lr"] if followers else 0.0


def parameters_norm(run: Run) -> float:
    """L2 norm of all parameters, each logical parameter counted once (collective).

    Dense squares are summed over the model-parallel ranks, those of expert
    parameters over the ranks that split them (the optimizer's expert_mp_group,
    expert tp x ep x pp). Under FSDP each rank holds its rows of every parameter: the
    optimizer's fp32 main parameters, whose norm it takes over the data-parallel ranks too.
    """
    if getattr(run.optimizer, "fully_sharded", False):
        return run.optimizer.main_params_norm()
    totals = {kind: torch.zeros((), dtype=torch.float64) for kind in ("dense", "expert")}
    for chunk in run.model:
        for param in counted_in_grad_norm(chunk.module):
            kind = "expert" if is_expert_parallel(param) else "dense"
            totals[kind] += param.detach().double().square().sum().cpu()
    groups = {"dense": run.state.mp}
    if run.optimizer.expert_mp_group is not None:  # set alike on every rank
        groups["expert"] = run.optimizer.expert_mp_group
    for kind, group in groups.items():
        if group.size > 1:
            totals[kind] = totals[kind].to(run.device)
            dist.all_reduce(totals[kind], group=group.group)
    return float((totals["dense"].cpu() + totals["expert"].cpu()).sqrt())


def known_peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak TFLOP/s of a known GPU (by its name), else None (a CPU, or a GPU
    the table does not name)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in _GPU_PEAK_TFLOPS.items() if key in name), None)


def _measured_peak(device: torch.device) -> float:
    """The reference measured on `device`: a bf16 matmul on a GPU, cpu_peak_tflops on a
    CPU."""
    if device.type == "cuda":
        log.warning("no known peak for %s: MFU uses a measured bf16 matmul",
                    torch.cuda.get_device_name(device))  # fmt: skip
        return measure_peak_tflops(4096, device=device)
    return cpu_peak_tflops()


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.4e}"
    return str(value)
