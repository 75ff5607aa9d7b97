"""The native index builders: hand-worked examples, and the numpy reference on random inputs."""

import sys

import numpy as np
import pytest

from mp_data import index_builders, index_reference
from mp_data.index_builders import (
    build_blending_indices,
    build_exhaustive_blending_indices,
    build_sample_idx,
    sample_index_dtype,
)


def i32(values):
    return np.array(values, dtype=np.int32)


# --- sample index: by hand -------------------------------------------------------------


def test_sample_index_by_hand_drop_last_with_extra_token():
    # Sequences of 5, 3, 4 tokens (12), L=4, e=1: n = (12 - 1) // 4 = 2.
    # Sample 0 takes 5 tokens of sequence 0 and the next starts 1 token before
    # that end, at (0, 4); sample 1 takes 1 + 3 + 1 tokens and ends at (2, 1),
    # so the next row is (2, 0).
    rows = build_sample_idx(i32([5, 3, 4]), i32([0, 1, 2]), 4, 1, 12)
    assert rows.tolist() == [[0, 0], [0, 4], [2, 0]]
    assert rows.dtype == np.int32


def test_sample_index_by_hand_keep_last_partial():
    # n = ceil(11 / 4) = 3; the last sample runs into the end of the stream,
    # Megatron's end row: (last position, its length - e) = (2, 3).
    rows = build_sample_idx(i32([5, 3, 4]), i32([0, 1, 2]), 4, 1, 12, False, 1)
    assert rows.tolist() == [[0, 0], [0, 4], [2, 0], [2, 3]]


def test_sample_index_by_hand_without_extra_token():
    # e=0: n = 12 // 4 = 3 and samples do not overlap; a sample that ends
    # exactly at a sequence's end leaves the offset at that length.
    rows = build_sample_idx(i32([5, 3, 4]), i32([0, 1, 2]), 4, 1, 12, True, 0)
    assert rows.tolist() == [[0, 0], [0, 4], [1, 3], [2, 4]]


def test_sample_index_by_hand_two_epochs_and_empty_sequences():
    # sizes [2, 0, 3], two epochs laid out as 2 0 1 | 1 0 2: lengths 3 2 0 0 2 3,
    # ends 3 5 5 5 7 10. L=3, e=1: n = (10 - 1) // 3 = 3. Row r ends at token
    # 3r + 1: row 1 in position 1 (end 5), offset 3 - 3 = 0; row 2 skips both
    # empty sequences to position 4 (end 7), offset 6 - 5 = 1; row 3 at
    # position 5, offset 9 - 7 = 2.
    rows = build_sample_idx(i32([2, 0, 3]), i32([2, 0, 1, 1, 0, 2]), 3, 2, 5)
    assert rows.tolist() == [[0, 0], [1, 0], [4, 1], [5, 2]]


def test_sample_index_keeps_megatrons_float32_ceiling_above_2_pow_24_tokens():
    # 16779763 = 1001 * 16763 tokens after the extra one: exactly 16763
    # samples. Megatron's float32 ceiling gives 16764 (float32(16779763) is
    # 16779764, and 16779764 / 1001 rounds above 16763); the extra row repeats
    # the end row, and n stays Megatron's.
    sizes, docs = i32([16779764 - 10_000_000, 5_000_000, 5_000_000]), i32([0, 1, 2])
    rows = build_sample_idx(sizes, docs, 1001, 1, 16779764, False, 1)
    assert rows.shape == (16764 + 1, 2)
    assert rows[-2].tolist() == rows[-1].tolist() == [2, 4_999_999]
    reference = index_reference.build_sample_idx(sizes, docs, 1001, 1, 16779764, False, 1)
    assert np.array_equal(rows, reference)
    dropped = build_sample_idx(sizes, docs, 1001, 1, 16779764, True, 1)
    assert np.array_equal(dropped, rows[:-1])


def test_sample_index_float32_ceiling_can_also_lose_the_partial_sample():
    # 16778001 tokens after the extra one, L=1000: the exact ceiling is 16779,
    # but float32(16778001) = 16778000, so Megatron keeps 16778, no partial one.
    sizes = i32([16778002])
    kept = build_sample_idx(sizes, i32([0]), 1000, 1, 16778002, False, 1)
    assert kept.shape == (16778 + 1, 2)
    assert index_reference.count_samples(1, 16778002, 1000, False, 1) == 16778


# --- sample index: dtype ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_positions", "longest", "dtype"),
    [
        (0, 0, np.int32),
        (2**31 - 1, 2**31 - 1, np.int32),
        (2**31, 5, np.int64),
        (5, 2**31, np.int64),
    ],
)
def test_sample_index_dtype_threshold_is_2_pow_31(num_positions, longest, dtype):
    assert index_builders.INT32_SAMPLE_INDEX_LIMIT == 2**31
    assert sample_index_dtype(num_positions, longest) == dtype


def test_the_wrapper_builds_int64_past_the_threshold(monkeypatch):
    # The real threshold needs 2**31 positions; a lower one exercises the path.
    monkeypatch.setattr(index_builders, "INT32_SAMPLE_INDEX_LIMIT", 6)
    sizes = i32([5, 3, 4])
    assert build_sample_idx(sizes, i32([0, 1, 2]), 4, 1, 12).dtype == np.int32
    two_epochs = i32([0, 1, 2, 2, 1, 0])  # 6 positions: at the limit
    rows = build_sample_idx(sizes, two_epochs, 4, 2, 12)
    assert rows.dtype == np.int64
    assert np.array_equal(rows, index_reference.build_sample_idx(sizes, two_epochs, 4, 2, 12))
    assert build_sample_idx(i32([5, 6]), i32([0, 1]), 4, 1, 11).dtype == np.int64


# --- sample index: the reference on random inputs ---------------------------------------


def random_sample_case(rng):
    num_sequences = int(rng.integers(1, 40))
    longest = int(rng.choice([3, 20, 300]))
    sizes = rng.integers(1, longest + 1, num_sequences)
    sizes[rng.random(num_sequences) < rng.choice([0.0, 0.2, 0.6])] = 0
    # A split: a run of the dataset's sequences, as GPTDataset uses.
    first = int(rng.integers(0, num_sequences))
    ids = np.arange(first, int(rng.integers(first + 1, num_sequences + 1)), dtype=np.int32)
    if sizes[ids].sum() == 0:
        sizes[ids[-1]] = 1
    epochs = int(rng.integers(1, 4))
    document_index = np.tile(ids, epochs)
    rng.shuffle(document_index)
    return dict(
        sizes=sizes.astype(np.int32),
        document_index=document_index,
        sequence_length=int(rng.choice([1, 2, 3, 7, 16, 64])),
        num_epochs=epochs,
        tokens_per_epoch=int(sizes[ids].sum()),
        drop_last_partial_sequence=bool(rng.random() < 0.5),
        add_extra_token_to_sequence=int(rng.integers(0, 2)),
    )


@pytest.mark.parametrize("seed", range(8))
def test_sample_index_equals_the_reference_int32_and_int64(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        case = random_sample_case(rng)
        expected = index_reference.build_sample_idx(**case)
        rows = build_sample_idx(**case)
        assert rows.dtype == np.int32
        assert np.array_equal(rows, expected), case
        rows64 = index_builders._native.build_sample_idx_int64(*case.values())
        assert rows64.dtype == np.int64
        assert np.array_equal(rows64, expected), case


def test_random_cases_cover_the_edges():
    rng = np.random.default_rng(0)
    cases = [random_sample_case(rng) for _ in range(400)]
    assert any(c["num_epochs"] > 1 for c in cases)
    assert {c["add_extra_token_to_sequence"] for c in cases} == {0, 1}
    assert {c["drop_last_partial_sequence"] for c in cases} == {True, False}
    assert any((c["sizes"][c["document_index"]] == 0).any() for c in cases)


def test_sample_index_reads_samples_that_tile_the_token_stream():
    # Independent of both builders: each sample spans exactly L (+ e) tokens.
    rng = np.random.default_rng(1)
    for _ in range(50):
        case = random_sample_case(rng)
        case["drop_last_partial_sequence"] = True
        rows = build_sample_idx(**case)
        lengths = case["sizes"][case["document_index"]].astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])[rows[:, 0]] + rows[:, 1]
        assert np.all(np.diff(starts) == case["sequence_length"])


# --- sample index: errors ----------------------------------------------------------------


def test_sample_index_errors_name_the_argument():
    sizes, docs = i32([5, 3, 4]), i32([0, 1, 2])
    with pytest.raises(TypeError, match="sizes must have dtype int32, got int64"):
        build_sample_idx(sizes.astype(np.int64), docs, 4, 1, 12)
    with pytest.raises(TypeError, match="document_index must be a numpy array"):
        build_sample_idx(sizes, [0, 1, 2], 4, 1, 12)
    with pytest.raises(ValueError, match="sequence_length=0 must be in"):
        build_sample_idx(sizes, docs, 0, 1, 12)
    with pytest.raises(ValueError, match="add_extra_token_to_sequence=2"):
        build_sample_idx(sizes, docs, 4, 1, 12, True, 2)
    with pytest.raises(ValueError, match=r"sizes\[1\]=-3 is negative"):
        build_sample_idx(i32([5, -3, 4]), docs, 4, 1, 12)
    with pytest.raises(ValueError, match="document_index is empty"):
        build_sample_idx(sizes, i32([]), 4, 1, 12)
    with pytest.raises(IndexError, match=r"document_index\[1\]=7 is not a sequence"):
        build_sample_idx(sizes, i32([0, 7, 2]), 4, 1, 12)


def test_more_tokens_than_the_document_index_holds_is_an_error():
    # 12 tokens, 20 claimed: n = 19 // 4 = 4, and row 3 (token 12 + e) is past
    # the end. Megatron's helper fails an assert here; both builders raise.
    for build in (build_sample_idx, index_reference.build_sample_idx):
        with pytest.raises(ValueError, match="ran out of tokens at sample 3 of 4"):
            build(i32([5, 3, 4]), i32([0, 1, 2]), 4, 1, 20)
        with pytest.raises(ValueError, match="ran out of tokens at sample 3 of 3"):
            build(i32([5, 3, 4]), i32([0, 1, 2]), 4, 1, 13)  # dropping, even one token
        assert build(i32([5, 3, 4]), i32([0, 1, 2]), 4, 1, 13, False).shape == (4, 2)


def test_the_native_module_refuses_to_convert_arrays():
    with pytest.raises(TypeError):
        index_builders._native.build_sample_idx_int32(
            np.array([5, 3, 4]), i32([0, 1, 2]), 4, 1, 12, True, 1
        )


# --- blending ----------------------------------------------------------------------------


def blend(weights, size, build=build_blending_indices):
    dataset_index = np.full(size, -1, dtype=np.int16)
    sample_index = np.full(size, -1, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64)
    build(dataset_index, sample_index, weights, len(weights), size)
    return dataset_index, sample_index


def test_blending_by_hand():
    # x = max(i, 1); pick the largest w * x - count:
    # i=0 (x=1): .5 .3 .2 -> 0;  i=1 (x=1): -.5 .3 .2 -> 1;  i=2: 0 -.4 .4 -> 2;
    # i=3: .5 -.1 -.4 -> 0;  i=4: 0 .2 -.2 -> 1;  i=5: .5 -.5 0 -> 0;
    # i=6: 0 -.2 .2 -> 2;  i=7: .5 .1 -.6 -> 0;  i=8: 0 .4 -.4 -> 1;  i=9: .5 -.3 -.2 -> 0.
    dataset_index, sample_index = blend([0.5, 0.3, 0.2], 10)
    assert dataset_index.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert sample_index.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]


def test_blending_ties_go_to_the_lowest_dataset():
    # i=0: .5 .5 (tie) -> 0; i=1: -.5 .5 -> 1; i=2: 0 0 (tie) -> 0; i=3 -> 1.
    dataset_index, sample_index = blend([0.5, 0.5], 4)
    assert dataset_index.tolist() == [0, 1, 0, 1]
    assert sample_index.tolist() == [0, 0, 1, 1]


def random_weights(rng):
    num_datasets = int(rng.integers(1, 9))
    kind = rng.integers(0, 3)
    if kind == 0:
        weights = rng.random(num_datasets) ** 3
    elif kind == 1:
        weights = np.ones(num_datasets)  # every step a tie
    else:
        weights = rng.integers(0, 4, num_datasets).astype(np.float64)
        weights[0] += 1
    return weights / weights.sum()


@pytest.mark.parametrize("seed", range(4))
def test_blending_equals_the_reference(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        weights, size = random_weights(rng), int(rng.integers(0, 600))
        native = blend(weights, size)
        reference = blend(weights, size, index_reference.build_blending_indices)
        assert np.array_equal(native[0], reference[0]), weights
        assert np.array_equal(native[1], reference[1]), weights


def test_blending_counts_follow_the_weights():
    # After i + 1 samples no dataset is a whole sample ahead of its share
    # w * (i + 1). Behind, the greedy rule lags by less than one sample with
    # two datasets and, measured, by up to ~1.9 with more (never 2).
    rng = np.random.default_rng(5)
    for _ in range(30):
        weights, size = random_weights(rng), 1000
        dataset_index, sample_index = blend(weights, size)
        one_hot = dataset_index[:, None] == np.arange(len(weights))[None, :]
        counts = np.cumsum(one_hot, axis=0)
        shares = np.outer(np.arange(1, size + 1), weights)
        assert np.all(counts - shares < 1)
        assert np.all(counts - shares > (-1 if len(weights) <= 2 else -2))
        for j in range(len(weights)):  # each dataset's samples in order 0, 1, 2, ...
            assert sample_index[dataset_index == j].tolist() == list(range(counts[-1, j]))


def test_blending_verbose_prints_the_ratios(capsys):
    blend_index = np.zeros(4, dtype=np.int16), np.zeros(4, dtype=np.int64)
    build_blending_indices(*blend_index, np.array([0.75, 0.25]), 2, 4, verbose=True)
    out = capsys.readouterr().out
    assert "building indices for blended datasets" in out
    assert "dataset 1, input: 0.25, achieved: 0.25" in out


def test_blending_errors_name_the_argument():
    good = np.zeros(4, dtype=np.int16), np.zeros(4, dtype=np.int64)
    weights = np.array([0.5, 0.5])
    with pytest.raises(TypeError, match="dataset_index must have dtype int16, got int32"):
        build_blending_indices(np.zeros(4, np.int32), good[1], weights, 2, 4)
    with pytest.raises(TypeError, match="weights must have dtype float64"):
        build_blending_indices(*good, weights.astype(np.float32), 2, 4)
    with pytest.raises(ValueError, match="weights has 2 entries; num_datasets=3"):
        build_blending_indices(*good, weights, 3, 4)
    with pytest.raises(ValueError, match="both must have size=5"):
        build_blending_indices(*good, weights, 2, 5)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        build_blending_indices(*good, np.array([np.nan, 1.0]), 2, 4)
    read_only = np.zeros(4, dtype=np.int64)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="dataset_sample_index is read-only"):
        build_blending_indices(good[0], read_only, weights, 2, 4)
    with pytest.raises(TypeError):  # the extension itself never fills a converted copy
        index_builders._native.build_blending_indices(
            np.zeros(4, np.int32), good[1], weights, 2, 4, False
        )


# --- exhaustive blending -----------------------------------------------------------------


def exhaust(sizes, build=build_exhaustive_blending_indices):
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    dataset_index = np.full(total, -1, dtype=np.int16)
    sample_index = np.full(total, -1, dtype=np.int64)
    build(dataset_index, sample_index, sizes, len(sizes))
    return dataset_index, sample_index


def test_exhaustive_blending_by_hand():
    # w = [.75, .25]. i=0 (x=1): .75 .25 -> 0; i=1 (x=1): -.25 .25 -> 1, which
    # is now used up; i=2, i=3: only dataset 0 is left.
    dataset_index, sample_index = exhaust([3, 1])
    assert dataset_index.tolist() == [0, 1, 0, 0]
    assert sample_index.tolist() == [0, 0, 1, 2]


def test_exhaustive_blending_skips_empty_datasets():
    # w = [0, 2/3, 1/3]; dataset 0 is used up from the start.
    # i=0: 2/3 1/3 -> 1; i=1: -1/3 1/3 -> 2 (used up); i=2 -> 1.
    dataset_index, sample_index = exhaust([0, 2, 1])
    assert dataset_index.tolist() == [1, 2, 1]
    assert sample_index.tolist() == [0, 0, 1]
    assert exhaust([0, 0])[0].tolist() == []


def test_exhaustive_blending_keeps_the_weights_of_all_datasets():
    # Megatron's helper does not renormalize once a dataset is used up.
    # w = [.2, .2, .6]: i=0 (x=1) -> 2; i=1: .2 .2 -.4 -> 0 (used up);
    # i=2 (x=2): .4 -.6 .2 -> 1 (used up); then dataset 2 to the end.
    dataset_index, _ = exhaust([1, 1, 3])
    assert dataset_index.tolist() == [2, 0, 1, 2, 2]


@pytest.mark.parametrize("seed", range(4))
def test_exhaustive_blending_equals_the_reference_and_uses_every_sample_once(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(40):
        num_datasets = int(rng.integers(1, 12))
        sizes = rng.integers(0, int(rng.choice([3, 50, 400])), num_datasets)
        dataset_index, sample_index = exhaust(sizes)
        reference = exhaust(sizes, index_reference.build_exhaustive_blending_indices)
        assert np.array_equal(dataset_index, reference[0]), sizes
        assert np.array_equal(sample_index, reference[1]), sizes
        for j, size in enumerate(sizes):
            assert sample_index[dataset_index == j].tolist() == list(range(size))


def test_exhaustive_blending_errors_name_the_argument():
    good = np.zeros(3, dtype=np.int16), np.zeros(3, dtype=np.int64)
    with pytest.raises(TypeError, match="sizes must have dtype int64, got int32"):
        build_exhaustive_blending_indices(*good, i32([1, 2]), 2)
    with pytest.raises(ValueError, match=r"sizes=\[4, -1\] must all be >= 0"):
        build_exhaustive_blending_indices(*good, np.array([4, -1]), 2)
    with pytest.raises(ValueError, match=r"both must have sum\(sizes\)=4"):
        build_exhaustive_blending_indices(*good, np.array([1, 3]), 2)
    with pytest.raises(ValueError, match="num_datasets=0 must be in"):
        build_exhaustive_blending_indices(*good, np.array([], dtype=np.int64), 0)


# --- strided arrays ---------------------------------------------------------------------


def strided_views(values):
    """Non-contiguous views of `values`: every other entry, reversed, and a record field.

    The field of a packed record (the value, then an int16) has a stride of
    itemsize + 2 bytes, no multiple of the itemsize: the extension steps
    through the strides in bytes, so each view gives what a contiguous copy
    gives.
    """
    values = np.asarray(values)
    every_other = np.zeros(2 * len(values), dtype=values.dtype)
    every_other[::2] = values
    reversed_ = values[::-1].copy()[::-1]
    records = np.zeros(len(values), dtype=[("value", values.dtype), ("pad", np.int16)])
    records["value"] = values
    views = [every_other[::2], reversed_, records["value"]]
    for view in views:
        assert not view.flags.c_contiguous or len(view) <= 1
        assert np.array_equal(view, values)
    return views


def test_strided_arrays_give_the_results_of_contiguous_copies():
    rng = np.random.default_rng(7)
    for _ in range(20):
        case = random_sample_case(rng)
        expected = index_reference.build_sample_idx(**case)
        sizes, document_index = case.pop("sizes"), case.pop("document_index")
        args = list(case.values())
        for sizes_view, index_view in zip(
            strided_views(sizes), strided_views(document_index), strict=True
        ):
            assert np.array_equal(build_sample_idx(sizes_view, index_view, **case), expected)
            for build in (
                index_builders._native.build_sample_idx_int32,
                index_builders._native.build_sample_idx_int64,
            ):
                rows = build(sizes_view, index_view, *args)
                contiguous = build(
                    np.ascontiguousarray(sizes_view), np.ascontiguousarray(index_view), *args
                )
                assert np.array_equal(rows, contiguous) and np.array_equal(rows, expected)

    for _ in range(10):
        weights, size = random_weights(rng), int(rng.integers(1, 300))
        expected = blend(weights, size)
        for dataset_index, sample_index, weights_view in zip(
            strided_views(np.full(size, -1, np.int16)),
            strided_views(np.full(size, -1, np.int64)),
            strided_views(weights),
            strict=True,
        ):
            index_builders._native.build_blending_indices(
                dataset_index, sample_index, weights_view, len(weights), size, False
            )
            assert np.array_equal(dataset_index, expected[0])
            assert np.array_equal(sample_index, expected[1])

        sizes = rng.integers(0, 40, len(weights))
        expected = exhaust(sizes)
        total = int(sizes.sum())
        for dataset_index, sample_index, sizes_view in zip(
            strided_views(np.full(total, -1, np.int16)),
            strided_views(np.full(total, -1, np.int64)),
            strided_views(sizes.astype(np.int64)),
            strict=True,
        ):
            index_builders._native.build_exhaustive_blending_indices(
                dataset_index, sample_index, sizes_view, len(sizes)
            )
            assert np.array_equal(dataset_index, expected[0])
            assert np.array_equal(sample_index, expected[1])


# --- installation ------------------------------------------------------------------------


def test_a_missing_extension_is_an_install_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mp_data._native", None)
    with pytest.raises(ImportError, match="uv sync --reinstall-package mp-data"):
        index_builders._load_native()
