"""mp-data: Megatron-compatible data for pretraining, from text to batches.

.bin/.idx indexed datasets (byte-compatible with Megatron-LM's MMIDIDX), native
index builders, GPT, mock and blended datasets with Megatron's sampling, FIM
datasets (fill-in-the-middle samples), SFT datasets (chat JSONL packed into
loss-masked samples), the
dataset builder, samplers and the data loader, tokenizers, and the `mp-data`
command (mp_data.cli). docs/data.md explains the pipeline.

Names are imported on first use: `mp-data inspect` should not wait seconds
for torch, which only the datasets and the loader need.
"""

import importlib

_EXPORTS = {
    "BlendedDataset": "mp_data.blended_dataset",
    "BlendedMegatronDatasetBuilder": "mp_data.builder",
    "DataConfig": "mp_data.config",
    "train_valid_test_num_samples": "mp_data.builder",
    "DATALOADER_TYPES": "mp_data.data_loader",
    "DataLoaderWorkerError": "mp_data.data_loader",
    "build_pretraining_data_loader": "mp_data.data_loader",
    "GPTDatasetConfig": "mp_data.gpt_config",
    "GPTDataset": "mp_data.gpt_dataset",
    "GPTFIMDataset": "mp_data.fim_dataset",
    "GPTFIMDatasetConfig": "mp_data.fim_dataset",
    "fim_dataset_fields": "mp_data.fim_config",
    "ltor_masks_and_position_ids": "mp_data.gpt_dataset",
    "build_blending_indices": "mp_data.index_builders",
    "build_exhaustive_blending_indices": "mp_data.index_builders",
    "build_sample_idx": "mp_data.index_builders",
    "sample_index_dtype": "mp_data.index_builders",
    "IndexedDatasetBuilder": "mp_data.indexed_builder",
    "merge_datasets": "mp_data.indexed_builder",
    "IndexedDataset": "mp_data.indexed_dataset",
    "DType": "mp_data.indexed_format",
    "get_bin_path": "mp_data.indexed_format",
    "get_idx_path": "mp_data.indexed_format",
    "MockGPTDataset": "mp_data.mock_dataset",
    "INDICES_KEPT": "mp_data.built_indices",
    "kept_indices": "mp_data.built_indices",
    "PaddedToBatches": "mp_data.padded_dataset",
    "MegatronPretrainingRandomSampler": "mp_data.samplers",
    "MegatronPretrainingSampler": "mp_data.samplers",
    "RandomSeedDataset": "mp_data.samplers",
    "SFTDataError": "mp_data.sft_conversations",
    "read_conversations": "mp_data.sft_conversations",
    "SFTDataset": "mp_data.sft_dataset",
    "write_chat_corpus": "mp_data.sft_example",
    "write_chat_tokenizer": "mp_data.sft_example",
    "SFTLowLevelDataset": "mp_data.sft_dataset",
    "pack_conversations": "mp_data.sft_packing",
    "packed_sample": "mp_data.sft_packing",
    "SFT_PROMPT_FORMATS": "mp_data.sft_tokenizer",
    "SFTTokenizer": "mp_data.sft_tokenizer",
    "Split": "mp_data.split",
    "parse_and_normalize_split": "mp_data.split",
    "split_indices": "mp_data.split",
    "split_matrix": "mp_data.split",
    "BertWordPieceCase": "mp_data.tokenizers",
    "BertWordPieceLowerCase": "mp_data.tokenizers",
    "GPT2BPETokenizer": "mp_data.tokenizers",
    "HuggingFaceTokenizer": "mp_data.tokenizers",
    "NullTokenizer": "mp_data.tokenizers",
    "TOKENIZER_TYPES": "mp_data.tokenizers",
    "Tokenizer": "mp_data.tokenizers",
    "build_tokenizer": "mp_data.tokenizers",
    "get_blend_from_list": "mp_data.blend",
    "vocab_size_with_padding": "mp_data.tokenizers",
    "write_docstring_corpus": "mp_data.python_corpus",
}
"""Public name -> the module that defines it."""

__all__ = [
    "DATALOADER_TYPES",
    "INDICES_KEPT",
    "SFT_PROMPT_FORMATS",
    "TOKENIZER_TYPES",
    "BertWordPieceCase",
    "BertWordPieceLowerCase",
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "DType",
    "DataConfig",
    "DataLoaderWorkerError",
    "GPT2BPETokenizer",
    "GPTDataset",
    "GPTDatasetConfig",
    "GPTFIMDataset",
    "GPTFIMDatasetConfig",
    "HuggingFaceTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingRandomSampler",
    "MegatronPretrainingSampler",
    "MockGPTDataset",
    "NullTokenizer",
    "PaddedToBatches",
    "RandomSeedDataset",
    "SFTDataError",
    "SFTDataset",
    "SFTLowLevelDataset",
    "SFTTokenizer",
    "Split",
    "Tokenizer",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "build_pretraining_data_loader",
    "build_sample_idx",
    "build_tokenizer",
    "fim_dataset_fields",
    "get_bin_path",
    "get_blend_from_list",
    "get_idx_path",
    "kept_indices",
    "ltor_masks_and_position_ids",
    "merge_datasets",
    "pack_conversations",
    "packed_sample",
    "parse_and_normalize_split",
    "read_conversations",
    "sample_index_dtype",
    "split_indices",
    "split_matrix",
    "train_valid_test_num_samples",
    "vocab_size_with_padding",
    "write_chat_corpus",
    "write_chat_tokenizer",
    "write_docstring_corpus",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mp_data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
