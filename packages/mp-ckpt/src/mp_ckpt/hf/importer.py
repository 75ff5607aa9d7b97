"""A Hugging Face model directory -> an mp checkpoint: a loop over its family's rules.

    import_hf(hf_dir, out_root)       an mp checkpoint at iteration 0
    logical_from_hf(state, config)    mp's logical tensors of a state dict
    model_config_from_hf(config)      mp's model settings (Megatron's names) of config.json

The family is config.json's model_type (mp_ckpt.families). common.pt records it
(common["family"]), so export-hf needs no --arch, beside the settings, the folder's
tokenizer files and special token ids, and its generation_config.json.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from mp_ckpt.core.checkpointer import Checkpointer
from mp_ckpt.core.layout import checkpoint_dir
from mp_ckpt.core.progress import progress as progress_reporter
from mp_ckpt.core.sharding import ShardedTensor
from mp_ckpt.families import family
from mp_ckpt.families.table import (
    HYBRID_SCOPES,
    Dims,
    Family,
    Rule,
    layer_scopes,
    mtp_layer_scopes,
    split_hybrid_pattern,
)
from mp_ckpt.hf.tokenizer import tokenizer_from_hf

__all__ = [
    "held_config",
    "import_hf",
    "iter_logical_from_hf",
    "logical_from_hf",
    "model_config_from_hf",
    "placed_rules",
    "read_hf_config",
    "read_json",
]

# Saved beside the weights by some versions, never weights: rotary tables, GPT-2's mask.
_NOT_WEIGHTS = re.compile(r"(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


def model_config_from_hf(config: dict) -> dict:
    """The model's settings under Megatron's names, from a Hugging Face config.json."""
    return family(config.get("model_type")).settings(config)


def import_hf(hf_dir: str | os.PathLike, out_root: str | os.PathLike, *,
              progress: bool = False) -> Path:  # fmt: skip
    """Writes an mp checkpoint (iteration 0, model only) from a local Hugging Face
    directory (config.json with safetensors or pytorch_model.bin) of any family in
    mp_ckpt.families.ARCHITECTURES. progress: report the weight files read on stderr."""
    hf_dir = Path(hf_dir)
    config = read_hf_config(hf_dir)
    model_config_from_hf(config)  # what mp cannot compute is refused before any weight is read
    generation = None
    if (hf_dir / "generation_config.json").exists():
        generation = read_json(hf_dir / "generation_config.json", "")
    state = _read_state(hf_dir, progress)
    config = held_config(state, config)
    model_config = model_config_from_hf(config)
    logical = logical_from_hf(state, config)
    pieces = {k: ShardedTensor(k, t.contiguous(), tuple(t.shape), (0,) * t.dim())
              for k, t in logical.items()}  # fmt: skip
    common = {"iteration": 0, "model_config": model_config,
              "family": family(config["model_type"]).model_type,
              "imported_from": str(hf_dir),
              "tokenizer": tokenizer_from_hf(hf_dir, config, generation)}  # fmt: skip
    if generation is not None:
        common["generation_config"] = generation
    Checkpointer(out_root).save(0, pieces, common=common)
    return checkpoint_dir(out_root, 0)


def logical_from_hf(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """mp's logical tensors from a Hugging Face state dict and its config.json (a dict).
    A tensor the family has no place for is refused by name."""
    return dict(iter_logical_from_hf(state, config))


def iter_logical_from_hf(
    state: Mapping[str, torch.Tensor],
    config: dict,
    *,
    wanted: Callable[[str], bool] | None = None,
    read: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """logical_from_hf a rule at a time: (mp's name, tensor) as each rule makes them, so
    that a caller holding one rule's tensors at a time can copy them out and drop them.

    wanted(name): whether the caller needs mp's tensor `name`; a rule none of whose
    tensors is wanted reads nothing (its Hugging Face names still count as used).
    read(value): the tensor a value of `state` stands for (state may hold placeholders,
    such as lazy.LazySafetensors' meta tensors); default: the value itself. A
    model_copy rule's tensor is compared with the model-level one it repeats only when
    every tensor is wanted (the model-level ones are then kept until the end)."""
    fam = family(config.get("model_type"))
    config = held_config(state, config)
    settings = fam.settings(config)
    if fam.prepare is not None:
        state = fam.prepare(state, config)
    dims = Dims.of(settings)
    used: set[str] = set()
    model_level: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"the Hugging Face weights have no tensor {name!r}")
        used.add(name)
        return state[name] if read is None else read(state[name])

    def hf_names(rule: Rule, layer: int | None) -> list[str]:
        names = [n.replace("{i}", str(layer)) for n in rule.hf_names]
        if not rule.per_expert:
            return names
        experts = range(settings["num_moe_experts"])
        return [n.replace("{e}", str(e)) for n in names for e in experts]

    def apply(rule: Rule, layer: int | None, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        targets = [name if rule.model_copy else prefix + name for name in rule.mp]
        if wanted is not None and not any(wanted(t) for t in targets):
            used.update(hf_names(rule, layer))
            return
        names = [n.replace("{i}", str(layer)) for n in rule.hf_names]
        if rule.per_expert:
            experts = settings["num_moe_experts"]
            tensors = [torch.stack([take(n.replace("{e}", str(e))) for e in range(experts)])
                       for n in names]  # fmt: skip
        else:
            tensors = [take(n) for n in names]
        imported = zip(targets, rule.import_(tensors, dims), strict=True)
        if rule.model_copy:  # copies of model-level tensors, imported before
            for name, tensor in imported:
                if name in model_level and not torch.equal(tensor, model_level[name]):
                    raise ValueError(f"the Hugging Face weights' {', '.join(names)} differs "
                                     f"from the tensor it repeats (mp's {name})")  # fmt: skip
            return
        for name, tensor in imported:
            if layer is None and wanted is None:
                model_level[name] = tensor
            yield name, tensor.contiguous()

    for rule in fam.rules_for("model", settings):
        yield from apply(rule, None, "")
    for rule, layer, prefix in placed_rules(fam, settings):
        yield from apply(rule, layer, prefix)
    _refuse_unused(state, used, settings)


def placed_rules(fam: Family, settings: dict) -> Iterator[tuple[Rule, int, str]]:
    """(rule, its Hugging Face layer number, mp's prefix) for each decoder layer (numbered
    by the family's hf_layer where it has one), then each multi-token prediction module (its
    own rules, then its transformer layer's, shaped as the last layer, under the family's
    mtp_sublayer names where it has them; in a hybrid model its sublayers',
    `_hybrid_mtp_rules`)."""
    layers = settings["num_layers"]
    for i in range(layers):
        number = i if fam.hf_layer is None else fam.hf_layer(settings, i)
        yield from ((rule, number, f"decoder.layers.{i}.")
                    for rule in _layer_rules(fam, settings, i))  # fmt: skip
    pattern = settings.get("hybrid_layer_pattern")
    _, mtp, depths = split_hybrid_pattern(pattern)
    if mtp is not None:
        yield from _hybrid_mtp_rules(fam, settings, mtp, depths)
        return
    if pattern and settings.get("mtp_num_layers"):
        raise ValueError(
            f"mtp_num_layers={settings['mtp_num_layers']} with hybrid_layer_pattern="
            f"{pattern!r}: a hybrid model's multi-token prediction modules are the pattern's "
            "parts after '/' ('<main>/<mtp>', one '/<mtp>' per module)"
        )
    for k in range(settings.get("mtp_num_layers") or 0):
        module = f"mtp.layers.{k}."
        yield from ((rule, layers + k, module) for rule in fam.rules_for("mtp", settings))
        shaped = [r for scope in mtp_layer_scopes(settings)
                  for r in fam.rules_for(scope, settings)]  # fmt: skip
        if fam.mtp_sublayer is None:  # a decoder layer's names, numbered after the decoder's
            yield from ((rule, layers + k, f"{module}transformer_layer.") for rule in shaped)
        else:  # names of their own (Qwen3-Next's mtp.layers.{k}.), numbered from 0
            yield from ((_moved(rule, *fam.mtp_sublayer), k, f"{module}transformer_layer.")
                        for rule in shaped)  # fmt: skip


def _hybrid_mtp_rules(
    fam: Family, settings: dict, module: str, depths: int
) -> Iterator[tuple[Rule, int, str]]:
    """The multi-token prediction modules of a hybrid model (table.py): module k's own rules
    at its first sublayer's number, each sublayer j's the rules of its kind (a decoder
    layer's, their Hugging Face names moved by the family's mtp_sublayer) at k L + j, and
    the module's last rules at its last sublayer's number."""
    if fam.mtp_sublayer is None:
        raise ValueError(f"the {fam.model_type} family converts no multi-token prediction "
                         "layers of a hybrid model")  # fmt: skip
    kinds = {symbol: [_moved(rule, *fam.mtp_sublayer)
                      for rule in fam.rules_for(HYBRID_SCOPES[symbol], settings)]
             for symbol in set(module)}  # fmt: skip
    size = len(module)
    for k in range(depths):
        first, own = k * size, f"mtp.layers.{k}."
        yield from ((rule, first, own) for rule in fam.rules_for("mtp", settings))
        for j, symbol in enumerate(module):
            yield from ((rule, first + j, f"{own}mtp_model_layer.layers.{j}.")
                        for rule in kinds[symbol])  # fmt: skip
        yield from ((rule, first + size - 1, own) for rule in fam.rules_for("mtp_last", settings))


def _moved(rule: Rule, decoder: str, sublayer: str) -> Rule:
    """The rule with its Hugging Face names under `sublayer` instead of `decoder`."""
    if not all(name.startswith(decoder) for name in rule.hf_names):
        raise ValueError(f"{rule.mp}: its Hugging Face names {rule.hf_names} are not all "
                         f"under {decoder!r}, the decoder layers' prefix")  # fmt: skip
    names = tuple(sublayer + name.removeprefix(decoder) for name in rule.hf_names)
    return replace(rule, hf=names[0] if isinstance(rule.hf, str) else names)


def _layer_rules(fam: Family, settings: dict, i: int) -> list[Rule]:
    """The rules of decoder layer i (table.layer_scopes: every layer's and those of its MLP,
    or in a hybrid model those of its kind)."""
    return [r for scope in layer_scopes(settings, i) for r in fam.rules_for(scope, settings)]


def held_config(state: dict, config: dict) -> dict:
    """config.json as the weights show it (the family's `held`)."""
    fam = family(config.get("model_type"))
    return config if fam.held is None else fam.held(config, state.keys())


def _refuse_unused(state: dict, used: set[str], settings: dict) -> None:
    left = sorted(n for n in set(state) - used if not _NOT_WEIGHTS.search(n))
    if left == ["lm_head.weight"] and not settings["untie_embeddings_and_output_weights"]:
        return  # a tied output layer saved anyway: the embedding it equals is imported
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise ValueError(f"the Hugging Face weights hold tensors mp has no place for: {shown}")


def read_hf_config(hf_dir: Path) -> dict:
    """The config.json of a Hugging Face directory; quantized weights are refused."""
    config = read_json(hf_dir / "config.json", "not a Hugging Face model directory")
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(
            f"{hf_dir / 'config.json'}: quantization_config (quant_method {method!r}): mp "
            "imports unquantized weights (fp32, bf16, fp16); dequantize them first"
        )
    return config


def read_json(path: Path, missing: str) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {missing}")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_state(hf_dir: Path, progress: bool = False) -> dict[str, torch.Tensor]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        from safetensors.torch import load_file

        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state = {}
        with progress_reporter(len(files), "import-hf", unit="file", enabled=progress) as bar:
            for file in files:
                if not (hf_dir / file).exists():
                    raise FileNotFoundError(f"{hf_dir / file} (named in {index.name}) is missing")
                state.update(load_file(str(hf_dir / file)))
                bar.update()
        return state
    if (hf_dir / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(hf_dir / "model.safetensors"))
    if (hf_dir / "pytorch_model.bin").exists():
        return torch.load(hf_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"{hf_dir} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )
