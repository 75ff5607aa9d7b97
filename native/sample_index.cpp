// The GPT sample index: where each sample of L (+ e) tokens starts in the
// token stream that document_index lays out, as Megatron-LM's
// build_sample_idx computes it (docs/formats/gpt-indices.md, "sample_index").
// Plain C++ over raw memory: module.cpp allocates the array and calls
// fill_sample_idx with the GIL released.
//
// Row r is (position in document_index, token offset in that sequence) of the
// flattened token r * L. Consecutive samples overlap by e tokens (the label of
// the last token), so each walk asks for L + e tokens and then steps back e.
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "index_builders.h"

namespace mp_data {

namespace {

// Megatron's count of samples. Keeping the last partial sample uses a ceiling
// computed in float32 (its helper writes `ceil(float(tokens) / seq_length)`);
// above 2^24 tokens that can differ from the exact ceiling by some samples,
// and we keep the float32 value because the shuffle index draws a permutation
// of exactly this many samples.
int64_t count_samples(int64_t tokens, int32_t sequence_length, bool drop_last) {
  if (drop_last) return tokens / sequence_length;
  return static_cast<int64_t>(
      std::ceil(static_cast<float>(tokens) / static_cast<float>(sequence_length)));
}

// The tokens the samples are cut from: all epochs, less the extra token of the
// last sample.
int64_t total_tokens(int32_t num_epochs, int64_t tokens_per_epoch,
                     int32_t add_extra_token_to_sequence) {
  return num_epochs * tokens_per_epoch - int64_t{add_extra_token_to_sequence};
}

void check_arguments(int64_t num_positions, int32_t sequence_length, int32_t num_epochs,
                     int64_t tokens_per_epoch, int32_t add_extra_token_to_sequence) {
  if (num_positions == 0) throw std::invalid_argument("document_index is empty");
  if (sequence_length < 1) {
    throw std::invalid_argument("sequence_length=" + std::to_string(sequence_length) +
                                " must be >= 1");
  }
  if (num_epochs < 1) {
    throw std::invalid_argument("num_epochs=" + std::to_string(num_epochs) + " must be >= 1");
  }
  if (tokens_per_epoch < 1) {
    throw std::invalid_argument("tokens_per_epoch=" + std::to_string(tokens_per_epoch) +
                                " must be >= 1");
  }
  if (tokens_per_epoch > std::numeric_limits<int64_t>::max() / num_epochs) {
    throw std::invalid_argument("num_epochs=" + std::to_string(num_epochs) +
                                " * tokens_per_epoch=" + std::to_string(tokens_per_epoch) +
                                " overflows int64");
  }
  if (add_extra_token_to_sequence != 0 && add_extra_token_to_sequence != 1) {
    throw std::invalid_argument("add_extra_token_to_sequence=" +
                                std::to_string(add_extra_token_to_sequence) +
                                " must be 0 or 1");
  }
}

}  // namespace

template <typename T>
int64_t sample_idx_num_samples(int64_t num_positions, int32_t sequence_length,
                               int32_t num_epochs, int64_t tokens_per_epoch,
                               bool drop_last_partial_sequence,
                               int32_t add_extra_token_to_sequence) {
  static_assert(std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>);
  check_arguments(num_positions, sequence_length, num_epochs, tokens_per_epoch,
                  add_extra_token_to_sequence);
  if (num_positions - 1 > std::numeric_limits<T>::max()) {
    throw std::invalid_argument(
        "document_index has " + std::to_string(num_positions) +
        " entries, too many for an int32 sample index: use the int64 one");
  }
  return count_samples(total_tokens(num_epochs, tokens_per_epoch, add_extra_token_to_sequence),
                       sequence_length, drop_last_partial_sequence);
}

template <typename T>
void fill_sample_idx(Strided<const int32_t> sizes, Strided<const int32_t> document_index,
                     int32_t sequence_length, int32_t num_epochs, int64_t tokens_per_epoch,
                     bool drop_last_partial_sequence, int32_t add_extra_token_to_sequence,
                     T* out) {
  const int64_t num_samples = sample_idx_num_samples<T>(
      document_index.size, sequence_length, num_epochs, tokens_per_epoch,
      drop_last_partial_sequence, add_extra_token_to_sequence);
  const int64_t num_positions = document_index.size;
  const int64_t extra = add_extra_token_to_sequence;
  const int64_t tokens = total_tokens(num_epochs, tokens_per_epoch, add_extra_token_to_sequence);
  // When the arguments agree (tokens_per_epoch = the tokens of one epoch of
  // document_index), only these rows may reach the end of the stream: when
  // kept, the last partial sample and any the float32 ceiling adds after it;
  // when dropped, none.
  const int64_t first_row_at_end = drop_last_partial_sequence
                                       ? num_samples + 1
                                       : (tokens + sequence_length - 1) / sequence_length;

  const int64_t num_sequences = sizes.size;
  auto length_at = [&](int64_t position) -> int64_t {
    const int32_t sequence = document_index[position];
    if (sequence < 0 || sequence >= num_sequences) {
      throw std::out_of_range("document_index[" + std::to_string(position) + "]=" +
                              std::to_string(sequence) + " is not a sequence of sizes (" +
                              std::to_string(num_sequences) + " sequences)");
    }
    return sizes[sequence];
  };
  int64_t position = 0;
  int64_t offset = 0;
  out[0] = 0;
  out[1] = 0;
  for (int64_t row = 1; row <= num_samples; ++row) {
    int64_t needed = int64_t{sequence_length} + extra;
    while (true) {
      const int64_t length = length_at(position);
      const int64_t remaining = length - offset;
      needed -= remaining;
      if (needed <= 0) {
        // The sample ends inside this sequence; the next one starts `extra`
        // tokens before that end, so that its first token is this one's label.
        offset += needed + remaining - extra;
        break;
      }
      if (position == num_positions - 1) {
        if (row < first_row_at_end) {
          throw std::invalid_argument(
              "document_index ran out of tokens at sample " + std::to_string(row) + " of " +
              std::to_string(num_samples) + ": num_epochs=" + std::to_string(num_epochs) +
              " * tokens_per_epoch=" + std::to_string(tokens_per_epoch) +
              " is more than the tokens of the sequences it lists");
        }
        // Megatron's end of the stream: the last sample (and any the float32
        // ceiling added) ends at the last sequence's end, less the extra token.
        offset = length - extra;
        break;
      }
      ++position;
      offset = 0;
    }
    out[2 * row] = static_cast<T>(position);
    out[2 * row + 1] = static_cast<T>(offset);
  }
}

template int64_t sample_idx_num_samples<int32_t>(int64_t, int32_t, int32_t, int64_t, bool,
                                                 int32_t);
template int64_t sample_idx_num_samples<int64_t>(int64_t, int32_t, int32_t, int64_t, bool,
                                                 int32_t);
template void fill_sample_idx<int32_t>(Strided<const int32_t>, Strided<const int32_t>, int32_t,
                                       int32_t, int64_t, bool, int32_t, int32_t*);
template void fill_sample_idx<int64_t>(Strided<const int32_t>, Strided<const int32_t>, int32_t,
                                       int32_t, int64_t, bool, int32_t, int64_t*);

}  // namespace mp_data
