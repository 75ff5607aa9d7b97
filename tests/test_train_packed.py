"""Packed documents through apps/gpt: samples of 64 tokens cut from a corpus of short
documents (1 to 40 tokens, each closed by the end-of-document token) train for 6
iterations with --reset-attention-mask --reset-position-ids at TP2 with sequence
parallelism, at PP4 (two middle stages, which read the documents too), and with context
parallelism (CP2 with each comm type, p2p ring, all_gather and a2a, and CP4 p2p;
documents cross the ranks' chunks) with the one-rank run's losses and gradient norms
(1e-5 relative); the curve differs from attending across documents.

A corpus whose documents are all multiples of 8 tokens long (as SFT samples are padded
under context parallelism) is split by document at CP2 and CP4 (each document cut into
2 x cp chunks of its own, mp_layers.PackedSeqParams): with a multi-token prediction
layer, micro-batches of two samples, it trains with the one-rank curve too at CP2 (p2p,
a2a) and CP4 p2p (all_gather computes the same blocks as p2p:
packages/mp-layers/tests/test_packed_context_parallel.py checks it).

A Mamba-hybrid model (a Mamba-2 layer, then attention, and a multi-token prediction module
of the same) trains packed documents with the one-rank curve, its MTP loss too, at TP2
with sequence parallelism and at CP2 (p2p attention beside the Mamba layer's
all-to-all), its curves differing from mixing across documents."""

import numpy as np
import pytest

from mp_data import IndexedDatasetBuilder
from mp_gpt.testing import (
    HYBRID_OPTIONS,
    assert_same_curve,
    curves_part,
    metrics_records,
    tiny_options,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB = 1000  # NullTokenizer: ids 0 .. 999, the last one (999) the end-of-document id
EOD = VOCAB - 1
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
LOGGED = ("lm loss", "grad_norm")
ITERATIONS = 6


def CP(size: int, comm: str) -> list[str]:
    return ["--context-parallel-size", str(size), "--cp-comm-type", comm]


def corpus(prefix: str, multiple: int = 1) -> None:
    """400 documents of 1 to 40 tokens and the end-of-document token, or of a multiple of
    `multiple` tokens with it (then every sample of 64 starts at a document's start)."""
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as builder:
        for _ in range(400):
            n = rng.integers(1, 41) if multiple == 1 else multiple * rng.integers(1, 6) - 1
            builder.add_item(np.append(rng.integers(0, EOD, n), EOD))
            builder.end_document()
        builder.finalize(prefix + ".idx")


def train_layouts(tmp_path, layouts: dict, common: list[str]) -> dict[str, list[dict]]:
    """Each layout (name -> (ranks, its flags)) trained with the common flags under
    tmp_path/name; its metrics records."""
    curves = {}
    for name, (ranks, flags) in layouts.items():
        run_on_ranks(train_on_rank, ranks, tiny_options(tmp_path / name, *common, *flags),
                     timeout=300)  # fmt: skip
        curves[name] = metrics_records(tmp_path / name)
    return curves


def test_packed_documents_train_alike_at_every_layout(tmp_path):
    prefix = str(tmp_path / "docs")
    corpus(prefix)
    data = ["--no-mock-data", "--data-path", prefix, "--split", "1,0,0",
            "--train-iters", str(ITERATIONS)]  # fmt: skip
    layouts = {
        "one": (1, PACKED),
        "across": (1, []),
        "tp2-sp": (2, [*PACKED, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "pp4": (4, [*PACKED, "--pipeline-model-parallel-size", "4"]),
        "cp2-p2p": (2, [*PACKED, *CP(2, "p2p")]),
        "cp4-p2p": (4, [*PACKED, *CP(4, "p2p")]),
        "cp2-all-gather": (2, [*PACKED, *CP(2, "all_gather")]),
        "cp2-a2a": (2, [*PACKED, *CP(2, "a2a")]),
    }
    curves = train_layouts(tmp_path, layouts, data)
    assert len(curves["one"]) == ITERATIONS
    for name in layouts.keys() - {"one", "across"}:
        assert_same_curve(curves[name], curves["one"], LOGGED, name)
    assert curves_part(curves["one"], curves["across"], LOGGED) > 1e-2


def test_documents_split_by_document_train_alike(tmp_path):
    prefix = str(tmp_path / "docs")
    corpus(prefix, multiple=8)
    flags = [*PACKED, "--no-mock-data", "--data-path", prefix, "--split", "1,0,0",
             "--train-iters", str(ITERATIONS), "--micro-batch-size", "2",
             "--mtp-num-layers", "1"]  # fmt: skip
    layouts = {
        "one": (1, []),
        "cp2-p2p": (2, CP(2, "p2p")),
        "cp2-a2a": (2, CP(2, "a2a")),
        "cp4-p2p": (4, CP(4, "p2p")),
    }
    curves = train_layouts(tmp_path, layouts, flags)
    assert len(curves["one"]) == ITERATIONS
    for name in layouts.keys() - {"one"}:
        assert_same_curve(curves[name], curves["one"], LOGGED, name)


def test_a_hybrid_model_trains_packed_documents_alike(tmp_path):
    prefix = str(tmp_path / "docs")
    corpus(prefix)
    # with a multi-token prediction module of the same two layers (Megatron's unified pattern)
    flags = [*HYBRID_OPTIONS, "--hybrid-layer-pattern", "M*/M*", "--no-mock-data",
             "--data-path", prefix, "--split", "1,0,0", "--train-iters", "4"]  # fmt: skip
    layouts = {
        "one": (1, PACKED),
        "across": (1, []),
        "tp2-sp": (2, [*PACKED, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "cp2-p2p": (2, [*PACKED, *CP(2, "p2p")]),
    }
    curves = train_layouts(tmp_path, layouts, flags)
    assert len(curves["one"]) == 4
    for name in ("tp2-sp", "cp2-p2p"):
        assert_same_curve(curves[name], curves["one"], (*LOGGED, "mtp_1 loss"), name)
    for key in ("lm loss", "mtp_1 loss"):
        # the pattern's one attention layer is all the masks reach: the curves part little
        assert curves_part(curves["one"], curves["across"], (key,)) > 1e-4, key
