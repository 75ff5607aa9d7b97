"""Generate ``reference.pt``: an oracle fixture for mp's Muon optimizer.

What it produces
----------------
``reference.pt`` (beside this file), a ``torch.save``d dict of plain tensors
(fp32), lists, dicts, str/int/float/bool, with four parts:

* ``newton_schulz``: inputs and outputs of ``emerging_optimizers``'
  ``newton_schulz(x, steps, coefficient_type)`` for several shapes (tall, wide,
  square, batched 3-D), all coefficient types and two fp32-matmul precisions.
* ``scale_factor``: ``get_muon_scale_factor(out, in, mode)`` for the three modes.
* ``muon_steps``: three optimizer steps of Megatron-core's ``TensorParallelMuon``
  (single process, ``pg_collection=None``) for several configurations,
  including the fused-QKV split.
* ``muon_tp``: two steps of ``TensorParallelMuon`` over a 2-rank gloo
  tensor-parallel group on CPU, for ``tp_mode`` duplicated / distributed /
  blockwise and ``partition_dim`` 0 / 1; the per-rank parameter shards are
  recorded.

The generator only *calls* the reference code; it does not reimplement it.
Everything is seeded, so reruns on the same machine produce the same file
(bf16 matmul results may differ in the last bit on another CPU).

How to run (reference software goes in a scratch venv, not mp's venv)
---------------------------------------------------------------------
    uv venv /tmp/muon-venv --python $(pyenv root)/versions/3.12.1/bin/python3.12
    uv pip install --python /tmp/muon-venv/bin/python torch absl-py numpy \
        emerging-optimizers==0.3.0 megatron-core==0.19.2
    /tmp/muon-venv/bin/python packages/mp-optim/tests/assets/megatron_muon/generate.py

Versions used for the committed fixture: torch 2.15.0 (PyPI wheel, run on
CPU), emerging-optimizers 0.3.0, megatron-core 0.19.2, Python 3.12.1; oracle
``megatron.core.optimizer.emerging_optimizers.TensorParallelMuon``.
The exact versions are also stored in ``reference.pt["versions"]``.

No monkeypatch was needed: megatron-core 0.19.2 imports on a CPU-only machine
(it only warns that Transformer Engine / Apex are missing).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")  # TE/Apex-missing warnings from megatron's import

HERE = Path(__file__).resolve().parent
OUT_PATH = HERE / "reference.pt"
ORACLE = "megatron.core.optimizer.emerging_optimizers.TensorParallelMuon"


def _import_reference():
    import emerging_optimizers
    import megatron.core
    from emerging_optimizers.orthogonalized_optimizers import get_muon_scale_factor
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
    from emerging_optimizers.utils import fp32_matmul_precision
    from megatron.core.optimizer.emerging_optimizers import (
        HAVE_EMERGING_OPTIMIZERS,
        TensorParallelMuon,
    )

    assert HAVE_EMERGING_OPTIMIZERS, "megatron-core could not import emerging_optimizers"
    return dict(
        emerging_optimizers=emerging_optimizers,
        megatron_core=megatron.core,
        newton_schulz=newton_schulz,
        get_muon_scale_factor=get_muon_scale_factor,
        fp32_matmul_precision=fp32_matmul_precision,
        TensorParallelMuon=TensorParallelMuon,
    )


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def spread_matrix(gen: torch.Generator, shape, scale: float = 1e-2, decades: float = 3.0):
    """Random fp32 matrix (or batch) with singular values spread over `decades`
    decades (randn @ diag(logspace) @ randn), rescaled so its entries have
    standard deviation ~`scale`, like a real gradient."""
    *batch, m, n = shape
    r = min(m, n)
    a = torch.randn(*batch, m, r, generator=gen, dtype=torch.float64)
    b = torch.randn(*batch, r, n, generator=gen, dtype=torch.float64)
    s = torch.logspace(0.0, -decades, r, dtype=torch.float64)
    x = (a * s) @ b
    x = x * (scale / x.std())
    return x.to(torch.float32).contiguous()


def param_init(gen: torch.Generator, shape, std: float = 0.02):
    return (torch.randn(*shape, generator=gen) * std).to(torch.float32).contiguous()


# --------------------------------------------------------------------------
# newton_schulz / scale factor
# --------------------------------------------------------------------------

NS_SHAPES = {"wide": (24, 40), "tall": (40, 24), "square": (32, 32), "batched": (3, 16, 24)}

# (shape key, coefficient_type, steps, precision)
NS_CASES = [
    # quintic on every shape, bf16 ("medium") and fp32 ("highest")
    ("wide", "quintic", 5, "medium"),
    ("tall", "quintic", 5, "medium"),
    ("square", "quintic", 5, "medium"),
    ("batched", "quintic", 5, "medium"),
    ("wide", "quintic", 5, "highest"),
    ("batched", "quintic", 5, "highest"),
    # fewer / more steps than coefficient sets: quintic cycles its 5 sets
    ("wide", "quintic", 3, "medium"),
    ("wide", "quintic", 7, "medium"),
    # the other coefficient sets
    ("wide", "simple", 5, "medium"),
    ("square", "simple", 5, "highest"),
    ("wide", "polar_express", 5, "medium"),
    ("square", "polar_express", 10, "highest"),  # 8 sets, then repeat_last
    ("tall", "cans", 7, "highest"),  # 5 sets, then repeat_last
    ("tall", "aol", 6, "medium"),  # 4 sets, then cycles back to the first
    ("wide", "deepseekv4", 10, "medium"),
    ("tall", "deepseekv4", 10, "highest"),
]


def gen_newton_schulz(ref):
    newton_schulz = ref["newton_schulz"]
    prec_ctx = ref["fp32_matmul_precision"]
    gen = torch.Generator().manual_seed(1234)
    out = []
    for shape_key, coeff, steps, prec in NS_CASES:
        x = spread_matrix(gen, NS_SHAPES[shape_key])
        x_in = x.clone()
        with prec_ctx(prec):
            y = newton_schulz(x_in, steps, coeff)
        assert torch.equal(x_in, x), "newton_schulz modified its input"
        out.append(
            {
                "x": x,
                "steps": steps,
                "coefficient_type": coeff,
                "precision": prec,
                "out": y.to(torch.float32).contiguous().clone(),
            }
        )
    return out


SCALE_SHAPES = [(40, 24), (24, 40), (32, 32), (4096, 1024), (1024, 4096), (16, 8)]


def gen_scale_factor(ref):
    f = ref["get_muon_scale_factor"]
    return [
        {"out": o, "in": i, "mode": mode, "value": float(f(o, i, mode=mode))}
        for mode in ("spectral", "unit_rms_norm", "shape_scaling")
        for o, i in SCALE_SHAPES
    ]


# --------------------------------------------------------------------------
# Single-process TensorParallelMuon steps
# --------------------------------------------------------------------------

# Megatron's CLI defaults (megatron/training/arguments.py, --optimizer muon):
# --muon-momentum 0.9, no nesterov, --weight-decay 0.01 (decoupled), split QKV,
# fp32 matmul precision "medium", quintic, 5 NS steps, spectral scale, extra 1.0.
# (Megatron's factory never forwards `use_decoupled_weight_decay`, so it is
# always the class default True there.) lr 0.02 is our choice (no CLI default).
CLI_DEFAULTS = dict(
    lr=0.02,
    momentum=0.9,
    nesterov=False,
    weight_decay=0.01,
    use_decoupled_weight_decay=True,
    split_qkv=True,
    qkv_split_shapes=None,
    fp32_matmul_prec="medium",
    coefficient_type="quintic",
    num_ns_steps=5,
    scale_mode="spectral",
    extra_scale_factor=1.0,
)

# GQA: 2 query groups, 2 query heads per group, head dim 4, hidden 16.
# Per query group the rows are [q (2 heads * 4 = 8), k (4), v (4)].
QKV_SPLIT = [8, 4, 4]
QKV_SHAPE = (2 * sum(QKV_SPLIT), 16)  # (32, 16)

DENSE_PARAMS = {"w_wide": (8, 12), "w_tall": (12, 8)}

MUON_CASES = [
    ("a_cli_defaults", {}, DENSE_PARAMS, []),
    (
        "b_nesterov_unit_rms_norm",
        dict(nesterov=True, extra_scale_factor=0.2, scale_mode="unit_rms_norm"),
        DENSE_PARAMS,
        [],
    ),
    (
        "c_shape_scaling_l2_high",
        dict(
            scale_mode="shape_scaling",
            weight_decay=0.1,
            use_decoupled_weight_decay=False,
            fp32_matmul_prec="high",
        ),
        DENSE_PARAMS,
        [],
    ),
    (
        "d_split_qkv",
        dict(split_qkv=True, qkv_split_shapes=list(QKV_SPLIT)),
        {"qkv": QKV_SHAPE, "w_wide": (8, 12)},
        ["qkv"],
    ),
    (
        "e_no_split_qkv",
        dict(split_qkv=False, qkv_split_shapes=list(QKV_SPLIT)),
        {"qkv": QKV_SHAPE, "w_wide": (8, 12)},
        ["qkv"],
    ),
    (
        "f_highest_polar_express_nesterov",
        dict(
            momentum=0.95,
            nesterov=True,
            fp32_matmul_prec="highest",
            coefficient_type="polar_express",
            num_ns_steps=8,
        ),
        DENSE_PARAMS,
        [],
    ),
]

NUM_STEPS = 3


def _is_qkv(p):
    # Megatron's _muon_config_to_kwargs passes exactly this predicate.
    return getattr(p, "is_qkv", False)


def _make_oracle(ref, params, kwargs, pg_collection=None, tp_mode=None):
    extra = {}
    if tp_mode is not None:
        extra["tp_mode"] = tp_mode
    return ref["TensorParallelMuon"](
        params, is_qkv_fn=_is_qkv, pg_collection=pg_collection, **kwargs, **extra
    )


def gen_muon_steps(ref):
    gen = torch.Generator().manual_seed(4321)
    cases = []
    for name, overrides, shapes, qkv_names in MUON_CASES:
        kwargs = dict(CLI_DEFAULTS)
        kwargs.update(overrides)
        init = {n: param_init(gen, s) for n, s in shapes.items()}
        grads = [{n: spread_matrix(gen, s) for n, s in shapes.items()} for _ in range(NUM_STEPS)]

        params = {}
        for n, v in init.items():
            p = torch.nn.Parameter(v.clone())
            if n in qkv_names:
                p.is_qkv = True
            params[n] = p
        opt = _make_oracle(ref, list(params.values()), kwargs)

        params_after = []
        for step_grads in grads:
            for n, p in params.items():
                # clone: with L2 weight decay the oracle adds wd*p into p.grad in place
                p.grad = step_grads[n].clone()
            opt.step()
            params_after.append({n: p.detach().clone() for n, p in params.items()})
        momentum_after = {
            n: opt.state[p]["momentum_buffer"].detach().clone() for n, p in params.items()
        }
        cases.append(
            {
                "name": name,
                "kwargs": kwargs,
                "params": init,
                "is_qkv": list(qkv_names),
                "grads": grads,
                "params_after": params_after,
                "momentum_after": momentum_after,
            }
        )
    return cases


# --------------------------------------------------------------------------
# Tensor-parallel TensorParallelMuon (2 ranks, gloo, CPU)
# --------------------------------------------------------------------------

TP = 2
TP_STEPS = 2
# The sharded dim is the larger one, so that blockwise's scale factor (computed
# from the local shard's shape) differs from the full-matrix one under
# "spectral"; one extra case shards the smaller dim in distributed mode.
# Each rank holds the contiguous chunk `full.chunk(TP, dim=partition_dim)[rank]`.
# (name, tp_mode, partition_dim, full shape, kwarg overrides)
TP_CASES = [
    ("duplicated_pd0", "duplicated", 0, (16, 8), {}),
    ("duplicated_pd1", "duplicated", 1, (8, 16), {}),
    ("distributed_pd0", "distributed", 0, (16, 8), {}),
    ("distributed_pd1", "distributed", 1, (8, 16), {}),
    ("blockwise_pd0", "blockwise", 0, (16, 8), {}),
    ("blockwise_pd1", "blockwise", 1, (8, 16), {}),
    ("distributed_pd0_highest", "distributed", 0, (16, 8), dict(fp32_matmul_prec="highest")),
    (
        "distributed_pd0_small_dim_highest",
        "distributed",
        0,
        (8, 16),
        dict(fp32_matmul_prec="highest"),
    ),
    (
        "blockwise_pd1_unit_rms_norm_nesterov",
        "blockwise",
        1,
        (8, 16),
        dict(scale_mode="unit_rms_norm", nesterov=True),
    ),
]


def _tp_inputs():
    gen = torch.Generator().manual_seed(777)
    inputs = []
    for _name, _mode, _pd, shape, _ov in TP_CASES:
        full = param_init(gen, shape)
        grads = [spread_matrix(gen, shape) for _ in range(TP_STEPS)]
        inputs.append((full, grads))
    return inputs


def _tp_worker(rank: int, port: int, outdir: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        ref = _import_reference()
        from megatron.core.process_groups_config import ProcessGroupCollection

        tp_group = dist.new_group(list(range(TP)), backend="gloo")
        # Only what TensorParallelMuon reads: .tp (.expt_tp for expert params),
        # .gtp_remat / .expt_gtp_remat (None: no GTP weight rematerialization).
        pgc = ProcessGroupCollection(
            tp=tp_group, expt_tp=tp_group, gtp_remat=None, expt_gtp_remat=None
        )
        results = []
        for (_name, mode, pd, _shape, ov), (full, grads) in zip(
            TP_CASES, _tp_inputs(), strict=True
        ):
            kwargs = dict(CLI_DEFAULTS)
            kwargs.update(ov)
            p = torch.nn.Parameter(full.chunk(TP, dim=pd)[rank].clone().contiguous())
            p.tensor_model_parallel = True
            p.partition_dim = pd
            p.partition_stride = 1
            opt = _make_oracle(ref, [p], kwargs, pg_collection=pgc, tp_mode=mode)
            per_step = []
            for g in grads:
                p.grad = g.chunk(TP, dim=pd)[rank].clone().contiguous()
                opt.step()
                per_step.append(p.detach().clone())
            results.append(per_step)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gen_muon_tp():
    import torch.multiprocessing as mp

    inputs = _tp_inputs()
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_tp_worker, args=(_free_port(), outdir), nprocs=TP, join=True)
        per_rank = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(TP)]
    cases = []
    for i, ((name, mode, pd, _shape, ov), (full, grads)) in enumerate(
        zip(TP_CASES, inputs, strict=True)
    ):
        kwargs = dict(CLI_DEFAULTS)
        kwargs.update(ov)
        cases.append(
            {
                "name": name,
                "tp": TP,
                "tp_mode": mode,
                "partition_dim": pd,
                "kwargs": kwargs,
                "full_param": full,
                "grads_full": grads,
                "params_after_per_rank": [
                    [per_rank[r][i][s] for r in range(TP)] for s in range(TP_STEPS)
                ],
            }
        )
    return cases


# --------------------------------------------------------------------------


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # fixed reduction order for fp32 CPU matmuls
    ref = _import_reference()
    fixture = {
        "versions": {
            "torch": str(torch.__version__),
            "emerging_optimizers": str(ref["emerging_optimizers"].__version__),
            "megatron_core": str(ref["megatron_core"].__version__),
            "oracle": ORACLE,
        },
        "newton_schulz": gen_newton_schulz(ref),
        "scale_factor": gen_scale_factor(ref),
        "muon_steps": gen_muon_steps(ref),
        "muon_tp": gen_muon_tp(),
    }
    torch.save(fixture, OUT_PATH)
    size = OUT_PATH.stat().st_size
    print(f"wrote {OUT_PATH} ({size} bytes)")
    assert size < 300_000, "fixture is over the 300 KB budget"


if __name__ == "__main__":
    sys.exit(main())
