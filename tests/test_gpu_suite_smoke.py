"""ci/bench/gpu_suite.py --cpu-smoke runs every step of the GPU suite end to end on the
CPU with tiny shapes: the smoke run trains, saves, resumes and generates; each training
shape's bf16 variant, the generation comparison and the packed-attention timing give
figures; a variant whose flag
the parser refuses is reported with the parser's reason; the table names every step."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # conftest.py runs it first

SUITE = Path(__file__).resolve().parents[1] / "ci" / "bench" / "gpu_suite.py"


def _load_suite(monkeypatch):
    """gpu_suite.py as a module, in this process, where other tests have most likely
    imported torch and transformers already (seconds on 2 cores); the path, modules and
    environment variables the suite changes are put back afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("PYTHONPATH", "MP_DEVICE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "")  # records the value to put back ...
        monkeypatch.delenv(name)  # ... and starts from none
    monkeypatch.setenv("MP_DEVICE", "cpu")
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    suite = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite", suite)
    spec.loader.exec_module(suite)
    return suite


def test_cpu_smoke_runs_every_step(tmp_path, monkeypatch, capsys):
    suite = _load_suite(monkeypatch)
    out = tmp_path / "suite.json"
    every_variant = [name for name, _ in suite.VARIANTS]
    code = suite.main(["--cpu-smoke", "--out", str(out), "--steps", *suite.STEPS,
                       "--variants", *every_variant])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu-smoke"
    rows = {row["name"]: row for row in report["steps"]}
    for name, row in rows.items():
        assert name in printed, name
        if row["status"] == "ok":
            assert Path(row["log"]).is_file(), name

    smoke = rows["smoke"]["figures"]
    assert smoke["iterations"] == [1, 2, 3, 4, 5] and smoke["losses_finite"]
    assert len(smoke["generated"]) == 16
    assert (rows["cuda-tests"]["status"], rows["cuda-tests"]["reason"]) == (
        "skipped",
        "no CUDA device",
    )

    for shape in ("llama-3.2-1b", "llama-3-8b-layers"):
        assert rows[f"train {shape}"]["figures"]["variants"] == ["bf16"]
        figures = rows[f"train {shape} bf16"]["figures"]
        assert figures["tokens_per_s"] > 0 and figures["hf_tokens_per_s"] > 0
        assert figures["flops_per_iteration"] > 0 and figures["peak_tflops"] > 0
        assert figures["parameters"] == figures["hf_parameters"]
        for run in figures["losses"] + figures["hf_losses"]:
            assert all(math.isfinite(loss) for loss in run)
        # Variants beside bf16 are only checked on the CPU: refused with pretrain_gpt.py's
        # line (an unknown flag; FP8 without a GPU), or accepted and not run.
        for variant in ("fp8", "torch-compile", "fp8-compile", "compile-fused"):
            row = rows[f"train {shape} {variant}"]
            assert row["status"] in ("refused", "checked"), row
            assert row["reason"] and row["reason"] in printed
    # The comparison raises unless both sides gave every new token; timings on a busy
    # CPU are not checked.
    generated = rows["generate llama-3.2-1b"]
    assert generated["status"] == "ok" and {"b1", "b2"} <= set(generated["figures"])
    # Packed attention: without a GPU the same per-document path on both packed sides.
    packed = rows["packed"]["figures"]
    assert rows["packed"]["status"] == "ok" and not packed["varlen_kernel"]
    assert packed["max_difference"] == 0.0 and packed["dense_mask_ms"] > 0
    # The profile step: where one iteration's time goes; on the CPU by top-level operator.
    for shape in ("llama-3.2-1b", "llama-3-8b-layers"):
        row = rows[f"profile {shape} bf16"]
        assert row["status"] == "ok", row
        profiled = row["figures"]
        assert 0 < profiled["busy_ms"] <= profiled["iteration_ms"]
        assert sum(profiled["share_of_iteration"].values()) == pytest.approx(1.0, abs=1e-3)
        assert profiled["top_kernels"] and profiled["share_of_iteration"]["attention"] > 0
        for variant in ("torch-compile", "compile-fused", "fp8-compile-fused"):
            assert rows[f"profile {shape} {variant}"]["status"] in ("refused", "checked")


def test_profile_step_sorts_gpu_kernels_by_kind():
    sys.path.insert(0, str(SUITE.parent))
    try:
        import kernel_time
    finally:
        sys.path.remove(str(SUITE.parent))
    names = {
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n_tilesize128x128x128_cublas": "matmul",  # FP8
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>": "attention",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
        "void at::native::multi_tensor_apply_kernel<FusedAdam>": "optimizer",
        "Memcpy HtoD (Pageable -> Device)": "copies",
        "void at::native::vectorized_elementwise_kernel<4, silu>": "elementwise and other",
    }
    assert {n: kernel_time.kernel_kind(n) for n in names} == names
    # Two kernels of 3 and 1 us over a 10 us span: 30% matmul, 10% other, 60% idle.
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_a", "ts": 100.0, "dur": 3.0},
        {"ph": "X", "cat": "kernel", "name": "elementwise_b", "ts": 109.0, "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},
    ]
    found = kernel_time.kernel_time(events, gpu=True)
    assert found["iteration_ms"] == 0.01 and found["busy_ms"] == 0.004
    assert found["share_of_iteration"] == {"matmul": 0.3, "elementwise and other": 0.1,
                                           "idle": 0.6}  # fmt: skip
    assert [k["name"] for k in found["top_kernels"]] == ["nvjet_tst_a", "elementwise_b"]


def test_one_training_step_alternates_its_variants_with_one_transformers_run(tmp_path, monkeypatch):
    # Each round runs every variant, then the transformers loop once, in one process.
    suite = _load_suite(monkeypatch)
    variants = [["bf16", []], ["clip-0.5", ["--clip-grad", "0.5"]]]
    kwargs = {"mode": "cpu-smoke", "shape_name": "llama-3.2-1b", "variants": variants}
    step = suite._Runner(tmp_path, "fork", 1.0)("train llama-3.2-1b", "train", kwargs, 300)
    rows = suite._variant_rows(step, variants)
    assert [(r.name, r.status) for r in rows] == [
        ("train llama-3.2-1b", "ok"),
        ("train llama-3.2-1b bf16", "ok"),
        ("train llama-3.2-1b clip-0.5", "ok"),
    ], step.reason
    hf = rows[0].figures["transformers"]
    rounds = rows[0].figures["rounds"]
    assert len(hf["run_s"]) == len(hf["losses"]) == rounds
    assert "bf16, clip-0.5" in suite._summary(rows[0])
    for row, (_, flags) in zip(rows[1:], variants, strict=True):
        figures = row.figures
        assert figures["flags"] == flags and len(figures["run_s"]) == rounds
        pairs = zip(figures["setup_s"], figures["run_s"], strict=True)
        assert all(0 <= setup <= run for setup, run in pairs)
        assert figures["hf_tokens_per_s"] == hf["tokens_per_s"] > 0
        assert figures["tokens_per_s"] > 0 and figures["peak_tflops"] > 0
        assert row.seconds == pytest.approx(sum(figures["run_s"]), abs=0.1)
    # Both variants build the same model from the same seed and data: the same first loss.
    assert rows[1].figures["losses"][0][0] == rows[2].figures["losses"][0][0]
    # A step that fails gives each of its variants a row that says so.
    failed = suite.Row("train x", "failed", 1.0, reason="RuntimeError: out of memory")
    assert [(r.name, r.status) for r in suite._variant_rows(failed, variants)] == [
        ("train x", "failed"), ("train x bf16", "failed"), ("train x clip-0.5", "failed")
    ]  # fmt: skip


def test_each_finished_step_is_printed_and_in_the_report(tmp_path, monkeypatch, capsys):
    # A suite that a device command's time limit stops keeps every step it finished: the
    # report is rewritten (through a temporary name) and the row printed as each step ends.
    suite = _load_suite(monkeypatch)
    out = tmp_path / "suite.json"
    rows = suite._Rows(out, "cpu-smoke", 0.0)
    rows.append(suite.Row("cuda-tests", "skipped", reason="no CUDA device"))
    assert [r["name"] for r in json.loads(out.read_text())["steps"]] == ["cuda-tests"]
    rows.append(suite.Row("train s v", "refused", reason="--flag needs a GPU"))
    assert [r["status"] for r in json.loads(out.read_text())["steps"]] == ["skipped", "refused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite.json"]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[:2] == ["cuda-tests", "skipped"]
    assert printed[1].split()[:4] == ["train", "s", "v", "refused"]
    assert printed[1].endswith("--flag needs a GPU")


def test_variants_choose_what_is_profiled(tmp_path, monkeypatch):
    suite = _load_suite(monkeypatch)
    out = tmp_path / "suite.json"
    code = suite.main(["--cpu-smoke", "--steps", "profile", "--shapes", "llama-3.2-1b",
                       "--variants", "compile-fused", "--out", str(out)])  # fmt: skip
    assert code == 0
    steps = json.loads(out.read_text())["steps"]
    assert [(s["name"], s["status"]) for s in steps] == [
        ("profile llama-3.2-1b compile-fused", "checked")
    ]
