// Blending: which dataset serves each sample of a blend, and which of its
// samples, as Megatron-LM's build_blending_indices and
// build_exhaustive_blending_indices choose them (shared/formats/gpt-indices.md,
// "Blending").
//
// No randomness: sample i goes to the dataset furthest behind its share,
// argmax_j (w_j * max(i, 1) - count_j), ties to the lowest j (strict >). The
// error is computed in double exactly as written; the build turns off FMA
// contraction (-ffp-contract=off) so that every platform rounds it the same
// way and picks the same dataset.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "index_builders.h"

namespace mp_data {

namespace {

// dataset_index is int16, so 32768 datasets at most.
constexpr int64_t kMaxDatasets = int64_t{std::numeric_limits<int16_t>::max()} + 1;

void check_outputs(const py::array& dataset_index, const py::array& dataset_sample_index,
                   int64_t size) {
  if (dataset_index.ndim() != 1 || dataset_sample_index.ndim() != 1) {
    throw py::value_error("dataset_index (ndim=" + std::to_string(dataset_index.ndim()) +
                          ") and dataset_sample_index (ndim=" +
                          std::to_string(dataset_sample_index.ndim()) + ") must be 1-D");
  }
  if (dataset_index.shape(0) != size || dataset_sample_index.shape(0) != size) {
    throw py::value_error("dataset_index has " + std::to_string(dataset_index.shape(0)) +
                          " entries and dataset_sample_index " +
                          std::to_string(dataset_sample_index.shape(0)) + "; both must have " +
                          std::to_string(size));
  }
}

void check_num_datasets(int32_t num_datasets, const py::array& per_dataset, const char* name) {
  if (num_datasets < 1 || num_datasets > kMaxDatasets) {
    throw py::value_error("num_datasets=" + std::to_string(num_datasets) +
                          " must be in [1, " + std::to_string(kMaxDatasets) + "]");
  }
  if (per_dataset.ndim() != 1 || per_dataset.shape(0) != num_datasets) {
    throw py::value_error(std::string(name) + " must be 1-D with num_datasets=" +
                          std::to_string(num_datasets) + " entries");
  }
}

}  // namespace

void build_blending_indices(py::array_t<int16_t>& dataset_index,
                            py::array_t<int64_t>& dataset_sample_index,
                            const py::array_t<double>& weights, int32_t num_datasets,
                            int64_t size, bool verbose) {
  if (size < 0) throw py::value_error("size=" + std::to_string(size) + " must be >= 0");
  check_outputs(dataset_index, dataset_sample_index, size);
  check_num_datasets(num_datasets, weights, "weights");
  if (verbose) py::print("> building indices for blended datasets ...");

  auto chosen = dataset_index.mutable_unchecked<1>();
  auto chosen_sample = dataset_sample_index.mutable_unchecked<1>();
  auto weight = weights.unchecked<1>();
  std::vector<double> w(num_datasets);
  for (int32_t j = 0; j < num_datasets; ++j) w[j] = weight(j);
  std::vector<int64_t> counts(num_datasets, 0);
  {
    py::gil_scoped_release release;
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
      chosen(i) = static_cast<int16_t>(best);
      chosen_sample(i) = counts[best];
      ++counts[best];
    }
  }

  if (verbose) {
    py::print(" > sample ratios:");
    for (int32_t j = 0; j < num_datasets; ++j) {
      const double achieved =
          size > 0 ? static_cast<double>(counts[j]) / static_cast<double>(size) : 0.0;
      std::ostringstream line;
      line << "   dataset " << j << ", input: " << w[j] << ", achieved: " << achieved;
      py::print(line.str());
    }
  }
}

void build_exhaustive_blending_indices(py::array_t<int16_t>& dataset_index,
                                       py::array_t<int64_t>& dataset_sample_index,
                                       const py::array_t<int64_t>& sizes, int32_t num_datasets) {
  check_num_datasets(num_datasets, sizes, "sizes");
  auto size = sizes.unchecked<1>();
  std::vector<int64_t> size_of(num_datasets);
  int64_t total = 0;
  for (int32_t j = 0; j < num_datasets; ++j) {
    size_of[j] = size(j);
    if (size_of[j] < 0) {
      throw py::value_error("sizes[" + std::to_string(j) + "]=" + std::to_string(size_of[j]) +
                            " must be >= 0");
    }
    if (size_of[j] > std::numeric_limits<int64_t>::max() - total) {
      throw py::value_error("the sum of sizes overflows int64");
    }
    total += size_of[j];
  }
  check_outputs(dataset_index, dataset_sample_index, total);

  auto chosen = dataset_index.mutable_unchecked<1>();
  auto chosen_sample = dataset_sample_index.mutable_unchecked<1>();
  {
    py::gil_scoped_release release;
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
      chosen(i) = static_cast<int16_t>(best);
      chosen_sample(i) = counts[best];
      if (++counts[best] == size_of[best]) active.erase(active.begin() + best_slot);
    }
  }
}

}  // namespace mp_data
