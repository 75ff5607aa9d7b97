// mp_data._native: the pybind11 module of the index builders.
//
// Every array argument is `noconvert`: a wrong dtype is a TypeError rather
// than a silent copy, which for the in-place blending outputs would fill the
// copy and leave the caller's array untouched. Use mp_data.index_builders,
// which checks arguments with messages that name them.
#include "index_builders.h"

namespace py = pybind11;
using namespace pybind11::literals;

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native dataset index builders of mp-data (Megatron-LM's helpers semantics).";

  const char* sample_doc =
      "Sample index [n + 1, 2] of (position in document_index, offset); see "
      "mp_data.index_builders.build_sample_idx.";
  m.def("build_sample_idx_int32", &mp_data::build_sample_idx<int32_t>, sample_doc,
        "sizes"_a.noconvert(), "document_index"_a.noconvert(), "sequence_length"_a,
        "num_epochs"_a, "tokens_per_epoch"_a, "drop_last_partial_sequence"_a = true,
        "add_extra_token_to_sequence"_a = 1);
  m.def("build_sample_idx_int64", &mp_data::build_sample_idx<int64_t>, sample_doc,
        "sizes"_a.noconvert(), "document_index"_a.noconvert(), "sequence_length"_a,
        "num_epochs"_a, "tokens_per_epoch"_a, "drop_last_partial_sequence"_a = true,
        "add_extra_token_to_sequence"_a = 1);
  m.def("build_blending_indices", &mp_data::build_blending_indices,
        "Fills dataset_index and dataset_sample_index in place; see "
        "mp_data.index_builders.build_blending_indices.",
        "dataset_index"_a.noconvert(), "dataset_sample_index"_a.noconvert(),
        "weights"_a.noconvert(), "num_datasets"_a, "size"_a, "verbose"_a = false);
  m.def("build_exhaustive_blending_indices", &mp_data::build_exhaustive_blending_indices,
        "Fills dataset_index and dataset_sample_index in place; see "
        "mp_data.index_builders.build_exhaustive_blending_indices.",
        "dataset_index"_a.noconvert(), "dataset_sample_index"_a.noconvert(),
        "sizes"_a.noconvert(), "num_datasets"_a);
}
