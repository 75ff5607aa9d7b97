// The dataset index builders of mp-data, declared for the pybind11 module.
//
// Each follows the semantics of Megatron-LM's megatron/core/datasets/helpers.cpp
// (same arguments, same arrays out), so that the same data, seed and settings
// give the same samples; the algorithms are described in
// shared/formats/gpt-indices.md. The Python wrapper mp_data/index_builders.py
// validates arguments and picks the sample index dtype; the checks here are the
// ones memory safety needs, so that a direct call cannot read or write out of
// bounds.
#pragma once

#include <cstdint>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace mp_data {

namespace py = pybind11;

// Sample index [n + 1, 2] of (position in document_index, token offset), with
// T = int32 or int64 (the caller picks, by Megatron's rule).
template <typename T>
py::array_t<T> build_sample_idx(const py::array_t<int32_t>& sizes,
                                const py::array_t<int32_t>& document_index,
                                int32_t sequence_length, int32_t num_epochs,
                                int64_t tokens_per_epoch, bool drop_last_partial_sequence,
                                int32_t add_extra_token_to_sequence);

// Greedy weighted interleaving; fills the first `size` entries in place.
void build_blending_indices(py::array_t<int16_t>& dataset_index,
                            py::array_t<int64_t>& dataset_sample_index,
                            const py::array_t<double>& weights, int32_t num_datasets,
                            int64_t size, bool verbose);

// Every sample of every dataset exactly once, in proportion to the sizes.
void build_exhaustive_blending_indices(py::array_t<int16_t>& dataset_index,
                                       py::array_t<int64_t>& dataset_sample_index,
                                       const py::array_t<int64_t>& sizes, int32_t num_datasets);

}  // namespace mp_data
