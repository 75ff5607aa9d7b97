"""--full-validation and --multiple-validation-sets through the real loop: each evaluation
reads the whole validation set from its start, each sample once (the last global batch
padded with samples that count no loss), so its loss is the set's mean whatever the
evaluation batch, and every evaluation of an unchanged model (lr 0) gives the same value;
several validation sets are evaluated and logged each under its name, each with the loss
it has alone. The test split, evaluated once at the end, is read from its start (whole,
with full validation)."""

import numpy as np
import pytest

from mp_data import IndexedDatasetBuilder
from mp_gpt.testing import TINY_CONFIG, tiny_options, train_printed_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB = 1000
EOD = VOCAB - 1  # NullTokenizer's


def corpus(prefix: str, seed: int, documents: int) -> None:
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as builder:
        for _ in range(documents):
            top = 200 if seed % 2 else EOD  # the odd corpora use fewer ids
            builder.add_item(np.append(rng.integers(0, top, rng.integers(20, 90)), EOD))
            builder.end_document()
        builder.finalize(prefix + ".idx")


def evaluations(argv) -> list[tuple[str, float]]:
    """(label, lm loss) of each validation and test line the run printed."""
    lines = [line for line in train_printed_on_rank(argv).splitlines()
             if "validation" in line or line.startswith("test at")]  # fmt: skip
    return [(line.split(" | ")[0], float(line.split(" | lm loss ")[1].split(" |")[0]))
            for line in lines]  # fmt: skip


def validations(argv) -> list[tuple[str, float]]:
    """(label, lm loss) of each validation line the run printed."""
    return [(label, loss) for label, loss in evaluations(argv) if "validation" in label]


def options(tmp_path, name, *extra):
    """tiny_options over per-split data paths: tiny.yaml's data_path left out."""
    config = tmp_path / "tiny-per-split.yaml"
    if not config.exists():
        text = TINY_CONFIG.read_text().splitlines()
        config.write_text("\n".join(line for line in text if not line.startswith("data_path")))
    train = str(tmp_path / "train")
    return tiny_options(tmp_path / name, "--config", str(config), "--no-mock-data",
                        "--train-data-path", train,
                        "--test-data-path", str(tmp_path / "b"), "--lr", "0", "--min-lr", "0",
                        "--eval-interval", "2", *extra)  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpora")
    corpus(str(folder / "train"), 0, 200)
    corpus(str(folder / "a"), 2, 12)  # 12 x ~55 tokens / 64: about 10 samples
    corpus(str(folder / "b"), 3, 20)
    return folder


def test_full_validation_reads_the_whole_set_each_time(data):
    valid = ["--valid-data-path", str(data / "a")]
    full = run_on_ranks(validations, 1, options(data, "full", *valid, "--full-validation",
                                                "--eval-global-batch-size", "3"))[0]  # fmt: skip
    assert [label for label, _ in full] == ["validation at iteration 2", "final validation"]
    assert full[0][1] == full[1][1]  # the same samples, from the start, at lr 0
    # another evaluation batch at DP2 (another padding of the last batch): the same mean
    plain = run_on_ranks(validations, 2, options(data, "dp2", *valid, "--full-validation",
                                                 "--eval-global-batch-size", "2"))[-1]  # fmt: skip
    assert plain[0][1] == pytest.approx(full[0][1], rel=1e-6)
    # without full validation the evaluations read on: another value the second time
    read_on = run_on_ranks(validations, 1, options(data, "on", *valid, "--eval-iters", "1"))[0]
    assert read_on[0][1] != read_on[1][1]


def test_each_validation_set_is_evaluated_under_its_name(data):
    both = [
        "--valid-data-path",
        str(data / "a"),
        str(data / "b"),
        "--full-validation",
        "--multiple-validation-sets",
        "--validation-set-names",
        "wide",
        "narrow",
    ]
    lines = run_on_ranks(validations, 1, options(data, "both", *both))[0]
    assert [label for label, _ in lines] == [
        "validation-wide at iteration 2",
        "validation-narrow at iteration 2",
        "final validation-wide",
        "final validation-narrow",
    ]
    alone = {name: run_on_ranks(validations, 1, options(
        data, name, "--valid-data-path", str(data / name), "--full-validation"))[0][0][1]
        for name in ("a", "b")}  # fmt: skip
    assert lines[0][1] == pytest.approx(alone["a"], rel=1e-6)
    assert lines[1][1] == pytest.approx(alone["b"], rel=1e-6)
    assert lines[0][1] != lines[1][1]  # two sets, two losses


def test_the_test_split_is_read_from_its_start_at_the_end(data):
    """Over the validation set, at lr 0: the test evaluation at the end reads from its
    start, so it gives the first validation's loss, not the final one's (which reads on);
    with full validation it reads the set whole, as the validation does. (Set b holds
    ~17 samples: one epoch for either split's sample count, so both shuffle it alike.)"""
    same = ["--valid-data-path", str(data / "b"), "--test-data-path", str(data / "b")]
    lines = run_on_ranks(evaluations, 1, options(data, "test", *same, "--eval-iters", "1"))[0]
    assert [label for label, _ in lines] == [
        "validation at iteration 2",
        "final validation",
        "test at iteration 4",
    ]
    assert lines[2][1] == lines[0][1] != lines[1][1]
    full = run_on_ranks(evaluations, 2, options(data, "test-full", *same, "--full-validation",
                                                "--eval-global-batch-size", "2"))[-1]  # fmt: skip
    assert [label for label, _ in full][2] == "test at iteration 4"
    assert full[2][1] == pytest.approx(full[1][1], rel=1e-6)
    assert full[2][1] != lines[2][1]  # the whole set, not its first batch
