"""FimDataConfig: Megatron-LM's fill-in-the-middle flags (--fim-data, --fim-rate, ...), a
base of DataConfig; `fim_dataset_fields` turns them into GPTFIMDatasetConfig's fields."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FimDataConfig", "check_fim", "fim_dataset_fields"]


@dataclass(kw_only=True)
class FimDataConfig:
    fim_data: bool = False
    """Fill-in-the-middle samples (Megatron's GPTFIMDataset, mp_data.fim): each document
    piece of a sample is, with probability fim_rate, cut at two random characters and its
    parts reordered with the FIM tokens (prefix, suffix, middle), so that the model learns
    to fill a middle in. Needs data files and a tokenizer with text and the FIM tokens."""

    fim_rate: float = 0.5
    """Probability that a document piece is FIM-transformed."""

    fim_spm_rate: float = 0.5
    """Probability that a transformed piece is in suffix-prefix-middle order (else
    prefix-suffix-middle)."""

    fim_split_sample: str | None = None
    """A token (e.g. a file separator) around which a piece is split into fragments, each
    transformed with probability fim_fragment_rate (the piece with fim_rate)."""

    fim_fragment_rate: float | None = None
    """Probability that a fragment is transformed; needs fim_split_sample."""

    fim_no_prefix: str | None = None
    """A piece or fragment whose text starts with this is left as it is."""

    fim_prefix_token: str = "<fim_prefix>"
    """The token before the prefix."""

    fim_middle_token: str = "<fim_middle>"
    """The token before the middle."""

    fim_suffix_token: str = "<fim_suffix>"
    """The token before the suffix."""

    fim_pad_token: str = "<fim_pad>"
    """The token that pads a transformed sample shorter than the original."""

    fim_eod_token: str = "<|endoftext|>"
    """The end-of-document token a sample is split into pieces at."""


_DEFAULTS = {name: value for name, value in vars(FimDataConfig).items()
             if name.startswith("fim_") and name != "fim_data"}  # fmt: skip


def check_fim(config) -> None:
    """FIM's fields: set without fim_data, refused (they would do nothing); with it, no mock
    data or SFT (Megatron refuses mock data and builds SFT's dataset instead)."""
    if not config.fim_data:
        for name, default in _DEFAULTS.items():
            if getattr(config, name) != default:
                raise ValueError(f"{name}={getattr(config, name)!r} applies with "
                                 "fim_data=True; set fim_data or drop it")  # fmt: skip
        return
    if config.mock_data:
        raise ValueError("fim_data=True transforms text: mock_data=True has none")
    if config.sft:
        raise ValueError("fim_data=True and sft=True are two kinds of samples: give one")


def fim_dataset_fields(config) -> dict:
    """GPTFIMDatasetConfig's FIM fields from a DataConfig with fim_data."""
    roles = ("prefix", "middle", "suffix", "pad", "eod")
    return {
        "fim_rate": config.fim_rate, "fim_spm_rate": config.fim_spm_rate,
        "fim_extra_tokens": {r: getattr(config, f"fim_{r}_token") for r in roles},
        "fim_split_sample": config.fim_split_sample,
        "fim_fragment_rate": config.fim_fragment_rate, "fim_no_prefix": config.fim_no_prefix,
    }  # fmt: skip
