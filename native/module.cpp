// mp_data._native: the pybind11 module of the index builders, and the only
// file that includes pybind11 (its headers take seconds to compile; the
// algorithms, in plain C++, well under one).
//
// Every array argument is `noconvert`: a wrong dtype is a TypeError rather
// than a silent copy, which for the in-place blending outputs would fill the
// copy and leave the caller's array untouched. Use mp_data.index_builders,
// which checks arguments with messages that name them.
//
// Each binding checks what needs the numpy arrays (ndim, shapes) here and the
// values through index_builders.h, in a fixed order (with several wrong
// arguments, the first is the one named), takes strided views of the arrays
// (any strides: a non-contiguous array is not copied) and runs the algorithm
// with the GIL released. std::invalid_argument from the algorithms
// becomes ValueError in Python and std::out_of_range IndexError (pybind11's
// standard translation), as py::value_error and py::index_error do here.
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "index_builders.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

using mp_data::Strided;

template <typename T>
Strided<const T> view(const py::array_t<T>& array) {
  return {array.data(), array.shape(0), array.strides(0)};
}

// mutable_data() raises ValueError ("array is not writeable") for a read-only
// array.
template <typename T>
Strided<T> mutable_view(py::array_t<T>& array) {
  return {array.mutable_data(), array.shape(0), array.strides(0)};
}

template <typename T>
py::array_t<T> build_sample_idx(const py::array_t<int32_t>& sizes,
                                const py::array_t<int32_t>& document_index,
                                int32_t sequence_length, int32_t num_epochs,
                                int64_t tokens_per_epoch, bool drop_last_partial_sequence,
                                int32_t add_extra_token_to_sequence) {
  if (sizes.ndim() != 1 || document_index.ndim() != 1) {
    throw py::value_error("sizes (ndim=" + std::to_string(sizes.ndim()) +
                          ") and document_index (ndim=" + std::to_string(document_index.ndim()) +
                          ") must be 1-D");
  }
  const int64_t num_samples = mp_data::sample_idx_num_samples<T>(
      document_index.shape(0), sequence_length, num_epochs, tokens_per_epoch,
      drop_last_partial_sequence, add_extra_token_to_sequence);
  py::array_t<T> result({num_samples + 1, int64_t{2}});
  T* out = result.mutable_data();
  const Strided<const int32_t> lengths = view(sizes);
  const Strided<const int32_t> documents = view(document_index);
  {
    py::gil_scoped_release release;
    mp_data::fill_sample_idx<T>(lengths, documents, sequence_length, num_epochs,
                                tokens_per_epoch, drop_last_partial_sequence,
                                add_extra_token_to_sequence, out);
  }
  return result;
}

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

// One entry per dataset: weights, or the sizes of an exhaustive blend.
void check_per_dataset(int32_t num_datasets, const py::array& per_dataset, const char* name) {
  mp_data::check_num_datasets(num_datasets);
  if (per_dataset.ndim() != 1 || per_dataset.shape(0) != num_datasets) {
    throw py::value_error(std::string(name) + " must be 1-D with num_datasets=" +
                          std::to_string(num_datasets) + " entries");
  }
}

void build_blending_indices(py::array_t<int16_t>& dataset_index,
                            py::array_t<int64_t>& dataset_sample_index,
                            const py::array_t<double>& weights, int32_t num_datasets,
                            int64_t size, bool verbose) {
  if (size < 0) throw py::value_error("size=" + std::to_string(size) + " must be >= 0");
  check_outputs(dataset_index, dataset_sample_index, size);
  check_per_dataset(num_datasets, weights, "weights");
  if (verbose) py::print("> building indices for blended datasets ...");

  const Strided<int16_t> chosen = mutable_view(dataset_index);
  const Strided<int64_t> chosen_sample = mutable_view(dataset_sample_index);
  const Strided<const double> weight = view(weights);
  std::vector<double> w(num_datasets);
  for (int32_t j = 0; j < num_datasets; ++j) w[j] = weight[j];
  std::vector<int64_t> counts;
  {
    py::gil_scoped_release release;
    counts = mp_data::build_blending_indices(chosen, chosen_sample, w);
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
  check_per_dataset(num_datasets, sizes, "sizes");
  const mp_data::ExhaustiveSizes checked = mp_data::exhaustive_blending_sizes(view(sizes));
  check_outputs(dataset_index, dataset_sample_index, checked.total);

  const Strided<int16_t> chosen = mutable_view(dataset_index);
  const Strided<int64_t> chosen_sample = mutable_view(dataset_sample_index);
  {
    py::gil_scoped_release release;
    mp_data::build_exhaustive_blending_indices(chosen, chosen_sample, checked);
  }
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native dataset index builders of mp-data (Megatron-LM's helpers semantics).";

  const char* sample_doc =
      "Sample index [n + 1, 2] of (position in document_index, offset); see "
      "mp_data.index_builders.build_sample_idx.";
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, sample_doc, "sizes"_a.noconvert(),
        "document_index"_a.noconvert(), "sequence_length"_a, "num_epochs"_a,
        "tokens_per_epoch"_a, "drop_last_partial_sequence"_a = true,
        "add_extra_token_to_sequence"_a = 1);
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, sample_doc, "sizes"_a.noconvert(),
        "document_index"_a.noconvert(), "sequence_length"_a, "num_epochs"_a,
        "tokens_per_epoch"_a, "drop_last_partial_sequence"_a = true,
        "add_extra_token_to_sequence"_a = 1);
  m.def("build_blending_indices", &build_blending_indices,
        "Fills dataset_index and dataset_sample_index in place; see "
        "mp_data.index_builders.build_blending_indices.",
        "dataset_index"_a.noconvert(), "dataset_sample_index"_a.noconvert(),
        "weights"_a.noconvert(), "num_datasets"_a, "size"_a, "verbose"_a = false);
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
        "Fills dataset_index and dataset_sample_index in place; see "
        "mp_data.index_builders.build_exhaustive_blending_indices.",
        "dataset_index"_a.noconvert(), "dataset_sample_index"_a.noconvert(),
        "sizes"_a.noconvert(), "num_datasets"_a);
}
