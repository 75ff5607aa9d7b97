// Blending: which dataset serves each sample of a blend, and which of its
// samples, as Megatron-LM's build_blending_indices and
// build_exhaustive_blending_indices choose them (docs/formats/gpt-indices.md,
// "Blending"). Plain C++ over raw memory: module.cpp checks the arrays' shapes,
// prints the verbose ratios and calls these with the GIL released.
//
// No randomness: sample i goes to the dataset furthest behind its share,
// argmax_j (w_j * max(i, 1) - count_j), ties to the lowest j (strict >). The
// error is computed in double exactly as written; the build turns off FMA
// contraction (-ffp-contract=off) so that every platform rounds it the same
// way and picks the same dataset.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "index_builders.h"

namespace mp_data {

void check_num_datasets(int32_t num_datasets) {
  if (num_datasets < 1 || num_datasets > kMaxDatasets) {
    throw std::invalid_argument("num_datasets=" + std::to_string(num_datasets) +
                                " must be in [1, " + std::to_string(kMaxDatasets) + "]");
  }
}

std::vector<int64_t> build_blending_indices(Strided<int16_t> dataset_index,
                                            Strided<int64_t> dataset_sample_index,
                                            const std::vector<double>& w) {
  const int64_t size = dataset_index.size;
  const auto num_datasets = static_cast<int32_t>(w.size());
  std::vector<int64_t> counts(num_datasets, 0);
  for (int64_t i = 0; i < size; ++i) {
    // max(i, 1): Megatron's rule, so that sample 0 already favours the
    // heaviest dataset rather than seeing all errors at zero.
    const double x = std::max(static_cast<double>(i), 1.0);
    int32_t best = 0;
    double best_error = w[0] * x - static_cast<double>(counts[0]);
    for (int32_t j = 1; j < num_datasets; ++j) {
      const double error = w[j] * x - static_cast<double>(counts[j]);
      if (error > best_error) {
        best_error = error;
        best = j;
      }
    }
    dataset_index[i] = static_cast<int16_t>(best);
    dataset_sample_index[i] = counts[best];
    ++counts[best];
  }
  return counts;
}

ExhaustiveSizes exhaustive_blending_sizes(Strided<const int64_t> sizes) {
  ExhaustiveSizes checked{std::vector<int64_t>(sizes.size), 0};
  for (int64_t j = 0; j < sizes.size; ++j) {
    const int64_t size = sizes[j];
    if (size < 0) {
      throw std::invalid_argument("sizes[" + std::to_string(j) + "]=" + std::to_string(size) +
                                  " must be >= 0");
    }
    if (size > std::numeric_limits<int64_t>::max() - checked.total) {
      throw std::invalid_argument("the sum of sizes overflows int64");
    }
    checked.sizes[j] = size;
    checked.total += size;
  }
  return checked;
}

void build_exhaustive_blending_indices(Strided<int16_t> dataset_index,
                                       Strided<int64_t> dataset_sample_index,
                                       const ExhaustiveSizes& sizes) {
  const std::vector<int64_t>& size_of = sizes.sizes;
  const int64_t total = sizes.total;
  const auto num_datasets = static_cast<int32_t>(size_of.size());
  // Weights are the sizes over the total of all datasets, fixed once, as in
  // Megatron; a dataset that is used up leaves the candidates but the others
  // keep their weights. Empty datasets are used up from the start: Megatron
  // keeps one a candidate forever and, once the others are used up, writes
  // past the end of the arrays.
  std::vector<double> w(num_datasets);
  std::vector<int32_t> active;
  for (int32_t j = 0; j < num_datasets; ++j) {
    w[j] = static_cast<double>(size_of[j]) / static_cast<double>(total);
    if (size_of[j] > 0) active.push_back(j);
  }
  std::vector<int64_t> counts(num_datasets, 0);
  for (int64_t i = 0; !active.empty(); ++i) {
    const double x = std::max(static_cast<double>(i), 1.0);
    size_t best_slot = 0;
    double best_error = std::numeric_limits<double>::lowest();
    for (size_t slot = 0; slot < active.size(); ++slot) {
      const int32_t j = active[slot];
      const double error = w[j] * x - static_cast<double>(counts[j]);
      if (error > best_error) {
        best_error = error;
        best_slot = slot;
      }
    }
    const int32_t best = active[best_slot];
    dataset_index[i] = static_cast<int16_t>(best);
    dataset_sample_index[i] = counts[best];
    if (++counts[best] == size_of[best]) active.erase(active.begin() + best_slot);
  }
}

}  // namespace mp_data
