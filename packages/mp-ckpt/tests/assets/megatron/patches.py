"""CPU stand-ins that let megatron-core 0.19.2 train and checkpoint without a GPU.

Used only by ``generate.py`` (run in a venv that has megatron-core; the tests never import
this).  Megatron hard-codes CUDA in a handful of places; each function below replaces one
of them and says where it bites.  Nothing here changes numerics: the CPU takes the place
of "the current CUDA device" and the CPU generator the place of the CUDA generator.
"""

import os
import types

import torch


class _InertStream:
    """What ``torch.cuda.current_stream()`` returns here: every method does nothing."""

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass


def patch_all():
    """The stand-ins every worker applies after initializing megatron-core's parallel state
    (generate.py, load_export.py, grad_probe.py); patch_distopt_legacy_step is applied
    only where it is needed."""
    patch_cuda_calls()
    patch_megatron_rng_tracker()
    patch_psutil()
    patch_local_attention_for_mla()
    patch_torch_norm_sequence_parallel()


def patch_cuda_calls():
    """Module-level replacements in ``torch.cuda`` (process-wide, applied once per worker).

    * ``current_device`` -> cpu: megatron allocates with ``device=torch.cuda.current_device()``
      (RoPE ``inv_freq``, TP all-gather buffers, DDP grad buffers, the checkpoint's
      "finalize" flag tensor).
    * ``synchronize`` -> no-op: the torch_dist writer syncs after staging tensors to host.
    * ``current_stream`` -> an inert stream: DDP's grad sync waits on the current stream.
    * ``get_rng_state`` -> the CPU generator state, ``set_rng_state`` -> no-op,
      ``manual_seed`` -> ``torch.manual_seed``: ``save_checkpoint`` stores a
      ``cuda_rng_state`` and ``model_parallel_cuda_manual_seed`` seeds the CUDA generator.
    * ``get_device_properties`` -> a Hopper-like stub: ``validate_args`` asks the device
      architecture when TP > 1 (and then wants CUDA_DEVICE_MAX_CONNECTIONS=1, set here as
      a real Hopper run would).
    """
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _InertStream()
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=9, minor=0, name="cpu", total_memory=0, multi_processor_count=1
    )
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"


def patch_megatron_rng_tracker():
    """Megatron's ``CudaRNGStatesTracker`` saves/restores CUDA generator states through
    ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``; point them at
    the CPU generator so the tracker holds real states (``save_checkpoint`` writes them under
    ``rng_tracker_states`` and ``load_checkpoint`` refuses a checkpoint without them)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )


def patch_psutil():
    """The torch_dist writer logs process memory through psutil (debug log only); without
    psutil installed every save fails, so report 0 instead."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._process_memory = lambda: 0


def patch_distopt_legacy_step():
    """Legacy ``--ckpt-format torch`` + distributed optimizer, load side only:
    ``distrib_optim.pt`` has no per-parameter ``step`` but torch Adam's state does, and
    ``DistributedOptimizer._set_main_param_and_optimizer_states`` then raises
    ``KeyError: 'step'``.  Supply a non-tensor placeholder, which the original skips."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def with_step(self, model_param, tensors):
        tensors = dict(tensors)
        tensors.setdefault("step", None)
        return orig(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = with_step


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _names_cuda(d):
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


def cuda_as_cpu():
    """A ``TorchFunctionMode`` to wrap around optimizer construction/step and
    ``save_checkpoint``/``load_checkpoint`` (scoped, not process-wide):

    * a ``device=`` keyword naming CUDA becomes ``"cpu"`` (the optimizer's grad-norm and
      found-inf tensors, checkpoint reads use ``device="cuda"``);
    * ``Tensor.cuda()`` and ``Tensor.to("cuda")`` leave the tensor on the CPU;
    * ``Tensor.type()`` of a CPU float tensor answers ``"torch.cuda.FloatTensor"`` (and the
      half/bf16 names): the optimizers accept parameters only under those names.
    """
    from torch.overrides import TorchFunctionMode

    class CudaAsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs and _names_cuda(kwargs["device"]):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return _CUDA_TYPE_NAMES.get(name, name)
            if (
                func is torch.Tensor.to
                and len(args) >= 2
                and not isinstance(args[1], int)
                and _names_cuda(args[1])
            ):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CudaAsCpu()


def patch_local_attention_for_mla():
    """megatron-core 0.19.2's local spec cannot build multi-latent attention: MLASelfAttention
    passes ``k_channels`` and ``v_channels`` to its core attention, which the local
    ``DotProductAttention`` does not accept (only Transformer Engine's does). Its forward
    already takes keys and values of other widths than ``kv_channels`` (the scores contract
    the query's last dim, the context the value's; the softmax scale comes from MLA); only
    its output view assumes ``kv_channels`` per head, so accept the two arguments where
    ``v_channels`` equals ``kv_channels`` and refuse otherwise."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    init = DotProductAttention.__init__

    def with_channels(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"v_channels {v_channels} != kv_channels {config.kv_channels}")
        init(self, config, *args, **kwargs)

    DotProductAttention.__init__ = with_channels


def patch_torch_norm_sequence_parallel():
    """Megatron trains MoE under tensor parallelism only with sequence parallelism
    (MoELayer.forward refuses otherwise), which the local spec's norm without Apex,
    ``WrappedTorchNorm`` (a plain torch LayerNorm / RMSNorm), refuses. The norm itself needs
    nothing for it: under sequence parallelism each TP rank normalizes its own positions and
    the norm's weight gradient is summed over the TP group, which Megatron's
    ``finalize_model_grads`` does for every parameter marked ``sequence_parallel`` (as Apex's
    and Transformer Engine's norms mark theirs). So build the torch norm and mark it."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    new = WrappedTorchNorm.__new__

    def marked(cls, config, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = new(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = marked
