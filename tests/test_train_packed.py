"""Packed documents through apps/gpt: samples of 64 tokens cut from a corpus of short
documents (1 to 40 tokens, each closed by the end-of-document token) train with
--reset-attention-mask --reset-position-ids at TP2 with sequence parallelism and at PP4
(two middle stages, which read the documents too) with the one-rank run's losses and
gradient norms (1e-5 relative); the curve differs from attending across documents."""

import numpy as np
import pytest

from mp_data import IndexedDatasetBuilder
from mp_gpt.testing import assert_same_curve, metrics_records, tiny_options, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB = 1000  # NullTokenizer: ids 0 .. 999, the end-of-document id 1000
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
LOGGED = ("lm loss", "grad_norm")


def corpus(prefix: str) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as builder:
        for _ in range(400):
            builder.add_item(np.append(rng.integers(0, VOCAB, rng.integers(1, 41)), VOCAB))
            builder.end_document()
        builder.finalize(prefix + ".idx")


def test_packed_documents_train_alike_at_tp2_and_pp4(tmp_path):
    prefix = str(tmp_path / "docs")
    corpus(prefix)
    data = ["--no-mock-data", "--data-path", prefix, "--split", "1,0,0",
            "--train-iters", "4", "--peak-tflops", "1"]  # fmt: skip
    layouts = {
        "one": (1, PACKED),
        "across": (1, []),
        "tp2-sp": (2, [*PACKED, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "pp4": (4, [*PACKED, "--pipeline-model-parallel-size", "4"]),
    }
    curves = {}
    for name, (ranks, flags) in layouts.items():
        run_on_ranks(train_on_rank, ranks, tiny_options(tmp_path / name, *data, *flags),
                     timeout=300)  # fmt: skip
        curves[name] = metrics_records(tmp_path / name)
    assert len(curves["one"]) == 4
    for name in ("tp2-sp", "pp4"):
        assert_same_curve(curves[name], curves["one"], LOGGED, name)
    first = curves["one"][0]["lm loss"], curves["across"][0]["lm loss"]
    assert abs(first[0] - first[1]) > 1e-4 * abs(first[1]), first
