// The dataset index builders of mp-data, declared over raw memory in plain
// C++17 (no pybind11, so sample_index.cpp and blending_indices.cpp compile in
// well under a second each; module.cpp binds them to numpy arrays).
//
// Each follows the semantics of Megatron-LM's megatron/core/datasets/helpers.cpp
// (same arguments, same arrays out), so that the same data, seed and settings
// give the same samples; the algorithms are described in
// docs/formats/gpt-indices.md. The Python wrapper mp_data/index_builders.py
// validates arguments and picks the sample index dtype; the checks here and in
// module.cpp are the ones memory safety needs, so that a direct call of
// mp_data._native cannot read or write out of bounds. module.cpp checks what
// needs the numpy arrays (ndim, shapes); the functions here check the values.
//
// Errors are std::invalid_argument (pybind11 raises ValueError) and
// std::out_of_range (IndexError). None of these functions touches Python, so
// module.cpp calls them with the GIL released.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace mp_data {

// A 1-D view of a numpy array: `size` entries, `stride` BYTES apart (numpy's
// strides(0), which may be negative, zero, or no multiple of sizeof(T), as in
// the field of a packed record). It reads and writes through the strides as
// pybind11's unchecked<1>() does, so non-contiguous arrays need no copy.
template <typename T>
struct Strided {
  T* data;
  int64_t size;
  int64_t stride;  // in bytes

  T& operator[](int64_t i) const {
    using Byte = std::conditional_t<std::is_const_v<T>, const unsigned char, unsigned char>;
    return *reinterpret_cast<T*>(reinterpret_cast<Byte*>(data) + i * stride);
  }
};

// --- sample index (sample_index.cpp) -----------------------------------------

// The number of samples n of the sample index [n + 1, 2] over a document_index
// of `num_positions` entries, with T = int32 or int64 (the caller picks, by
// Megatron's rule). Checks every argument first (std::invalid_argument).
template <typename T>
int64_t sample_idx_num_samples(int64_t num_positions, int32_t sequence_length,
                               int32_t num_epochs, int64_t tokens_per_epoch,
                               bool drop_last_partial_sequence,
                               int32_t add_extra_token_to_sequence);

// Fills the sample index: `out` holds n + 1 rows of (position in
// document_index, token offset), row-major, with n =
// sample_idx_num_samples<T>(document_index.size, ...) for the same arguments.
// A document_index entry that is not a sequence of `sizes` is
// std::out_of_range; one that runs out of tokens, std::invalid_argument.
template <typename T>
void fill_sample_idx(Strided<const int32_t> sizes, Strided<const int32_t> document_index,
                     int32_t sequence_length, int32_t num_epochs, int64_t tokens_per_epoch,
                     bool drop_last_partial_sequence, int32_t add_extra_token_to_sequence,
                     T* out);

// --- blending (blending_indices.cpp) -----------------------------------------

// dataset_index is int16, so 32768 datasets at most.
constexpr int64_t kMaxDatasets = int64_t{std::numeric_limits<int16_t>::max()} + 1;

// num_datasets in [1, kMaxDatasets], else std::invalid_argument.
void check_num_datasets(int32_t num_datasets);

// Greedy weighted interleaving of weights.size() datasets (in [1,
// kMaxDatasets]): fills all dataset_index.size entries of both outputs, which
// have the same size, and returns how many samples each dataset got.
std::vector<int64_t> build_blending_indices(Strided<int16_t> dataset_index,
                                            Strided<int64_t> dataset_sample_index,
                                            const std::vector<double>& weights);

// The datasets' sizes of an exhaustive blend, copied and checked, and their
// sum: the length of both outputs. Copied (under the GIL, by module.cpp) so
// that the sizes the outputs were checked against are the ones the fill uses.
struct ExhaustiveSizes {
  std::vector<int64_t> sizes;
  int64_t total;
};

// A negative size, or a sum past int64, is std::invalid_argument.
ExhaustiveSizes exhaustive_blending_sizes(Strided<const int64_t> sizes);

// Every sample of every dataset exactly once, in proportion to the sizes
// (sizes.sizes.size() in [1, kMaxDatasets]); both outputs have sizes.total
// entries.
void build_exhaustive_blending_indices(Strided<int16_t> dataset_index,
                                       Strided<int64_t> dataset_sample_index,
                                       const ExhaustiveSizes& sizes);

}  // namespace mp_data
