"""An mp checkpoint -> a Hugging Face directory transformers loads: a loop over the
family's rules, one tensor in memory at a time.

    export_hf(checkpoint_dir, out_dir, arch=None)   config.json + model.safetensors
                                                    (sharded with an index above
                                                    max_shard_bytes), tokenizer files,
                                                    generation_config.json

The family is `arch`, else the one the checkpoint was imported as (common["family"]),
else the one its settings describe (families.family_of). Settings the tensors do not
show (norm epsilon, activation, rotary base and scaling, ...) come from the
checkpoint's common["model_config"] (Megatron names), completed by
common["config"]["model"] (the training run's TransformerConfig); the shapes (of
multi-latent attention: every width but the number of heads; of its indexer: all but
the top k), an untied output layer, q/k/v biases, which layers have experts and the
multi-token prediction modules come from the tensors; so do a hybrid model's layer
pattern (its multi-token prediction modules' layers too) and Mamba widths.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from mp_ckpt.core.progress import progress as progress_reporter
from mp_ckpt.core.reader import CheckpointReader
from mp_ckpt.core.regions import Region
from mp_ckpt.families import family, family_of
from mp_ckpt.families.table import HYBRID_SCOPES, Dims, Family, Rule, is_moe_layer
from mp_ckpt.hf.importer import placed_rules
from mp_ckpt.hf.safetensors_writer import ShardedSafetensorsWriter
from mp_ckpt.hf.tokenizer import (
    TOKENIZER_FILES,
    export_tokenizer,
    generation_config,
    write_atomically,
)

__all__ = ["TensorSource", "export_hf", "write_hf"]

_DEFAULT_SHARD_BYTES = 5 * 2**30
_QKV = "self_attention.linear_qkv.q"
_MLA = "decoder.layers.0.self_attention."
_INDEXER = _MLA + "core_attention.indexer."
_MTP_SUBLAYER = "mtp.layers.0.mtp_model_layer.layers.{j}."
"""Sublayer j of a hybrid model's first multi-token prediction module."""
_MTP_SUBLAYER_KEY = re.compile(r"^mtp\.layers\.0\.mtp_model_layer\.layers\.(\d+)\.")
Producer = Callable[[], torch.Tensor]


class TensorSource(Protocol):
    """Where an export reads the logical tensors: a CheckpointReader, or the pieces of
    a live run gathered tensor by tensor (live_export.GatheredPieces)."""

    def shape(self, key: str) -> tuple[int, ...]: ...

    def dtype(self, key: str) -> torch.dtype: ...

    def read(self, key: str, region: Region | None = None) -> torch.Tensor: ...


def export_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    arch: str | None = None,
    *,
    iteration: int | None = None,
    max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Path:
    """Writes the safetensors, the tokenizer files (hf.tokenizer), generation_config.json
    when a special token id is known, and config.json last. progress: report the tensors
    written on stderr."""
    reader = CheckpointReader(checkpoint, iteration=iteration)
    keys = [k for k in reader.keys if not k.startswith("optimizer.")]
    common = torch.load(reader.directory / "common.pt", weights_only=False)
    common = common if isinstance(common, dict) else {}
    return write_hf(reader, keys, common, out_dir, arch, where=str(reader.directory),
                    max_shard_bytes=max_shard_bytes, dtype=dtype, progress=progress)  # fmt: skip


def write_hf(
    source: TensorSource,
    keys: list[str],
    common: dict,
    out_dir: str | os.PathLike,
    arch: str | None = None,
    *,
    where: str,
    write: bool = True,
    max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Path:
    """export_hf from any source of the model's logical tensors (`keys`) and a
    common.pt-style dict; `where` names the source in errors. write=False reads every
    tensor in the same order and writes nothing (the ranks beside the writing one, when
    reading is collective)."""
    run_model = (common.get("config") or {}).get("model") or {}
    settings = _from_tensors(source, keys, dict(run_model) | dict(common.get("model_config") or {}))
    arch = arch or common.get("family") or family_of(settings)
    fam = family(arch)
    _check_layer_kinds(fam, settings)
    if settings.get("use_mup"):
        raise ValueError(
            f"model_config use_mup=True: {arch}'s Hugging Face model has no muP multipliers "
            "(the logits', the embedding's, the attention scale), so its logits would differ"
        )
    tensors = _plan(fam, source, settings, dtype)
    _check_keys(arch, keys, tensors, where)
    # What may be refused is computed before any tensor is read (by every rank alike).
    files, ids = export_tokenizer(common)
    saved_dtype = source.dtype("embedding.word_embeddings.weight")
    dtype_name = str(dtype or saved_dtype).removeprefix("torch.")
    config = fam.config(settings, _shapes(source, keys, settings), ids, dtype_name)
    out = Path(out_dir)
    if not write:
        for _, produce in tensors.values():
            produce()
        return out
    out.mkdir(parents=True, exist_ok=True)
    with progress_reporter(None, "export-hf", unit="tensor", enabled=progress) as bar, \
            ShardedSafetensorsWriter(out, max_shard_bytes) as writer:  # fmt: skip
        for name, (_, produce) in tensors.items():
            tensor = produce()
            writer.add(name, tensor)
            bar.update()
    for name, data in files.items():
        if name not in TOKENIZER_FILES:
            raise ValueError(f"common['tokenizer'] names a file {name!r}, not a tokenizer file")
        write_atomically(out / name, data)
    generation = generation_config(common, ids)
    if generation is not None:
        write_atomically(out / "generation_config.json", _json(generation))
    write_atomically(out / "config.json", _json(config))
    return out


def _layers(keys) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


def _mtp_sublayers(keys) -> list[str]:
    """The prefixes of the layers of a hybrid model's first multi-token prediction module."""
    found = {int(m.group(1)) for k in keys if (m := _MTP_SUBLAYER_KEY.match(k))}
    return [_MTP_SUBLAYER.format(j=j) for j in range(max(found) + 1 if found else 0)]


def _from_tensors(reader: TensorSource, keys: list[str], settings: dict) -> dict:
    """The settings with what the tensors show put over them."""
    layers = _layers(keys)
    routers = [f"decoder.layers.{i}.mlp.router.weight" in keys for i in range(layers)]
    sublayers = _mtp_sublayers(keys)
    hybrid = bool(settings.get("hybrid_layer_pattern") or sublayers) or any(
        ".mixer." in k for k in keys
    )
    # the first layer with attention, or with experts (in a hybrid model, possibly none, or
    # only a multi-token prediction module's)
    prefixes = [f"decoder.layers.{i}." for i in range(layers)] + sublayers
    q = next((p + _QKV for p in prefixes if f"{p}{_QKV}.weight" in keys), None)
    router = next((p + "mlp.router.weight" for p in prefixes
                   if f"{p}mlp.router.weight" in keys), None)  # fmt: skip
    shown = {
        "num_layers": layers,
        "untie_embeddings_and_output_weights": "output_layer.weight" in keys,
        "add_qkv_bias": q is not None and f"{q}.bias" in keys,
        "num_moe_experts": reader.shape(router)[0] if router else None,
        "moe_layer_freq": [1] if hybrid else [int(r) for r in routers],
        "mtp_num_layers": len({m.group(1) for k in keys
                               if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}) or None,
    }  # fmt: skip
    if hybrid:
        shown |= _hybrid_from_tensors(reader, keys, layers, sublayers, shown["mtp_num_layers"])
    if q is None and f"{_MLA}linear_kv_down_proj.weight" in keys:
        return settings | shown | _mla_from_tensors(reader, keys, settings)
    if q is not None:
        groups, per_group, d, h = reader.shape(f"{q}.weight")
        shown |= {"num_attention_heads": groups * per_group, "num_query_groups": groups,
                  "kv_channels": d, "hidden_size": h}  # fmt: skip
    return settings | shown


_HYBRID_KINDS = (("mixer.A_log", "M"), ("self_attention.A_log", "G"),
                 ("self_attention.linear_proj.weight", "*"), ("mlp.router.weight", "E"),
                 ("mlp.linear_fc2.weight", "-"))  # fmt: skip
"""A hybrid layer's kind by a tensor only that kind has."""


def _hybrid_from_tensors(reader: TensorSource, keys: list[str], layers: int,
                         sublayers: list[str], depths: int | None) -> dict:  # fmt: skip
    """A hybrid model's hybrid_layer_pattern, "<main>/<mtp>" with one "/<mtp>" for each of
    its `depths` multi-token prediction modules (their layers, `sublayers`, read from the
    first's), and Mamba widths: A_log [H], in_proj.z [G, H P / G, h], in_proj.B [G, N, h]."""
    prefixes = {f"decoder.layers.{i}.": f"decoder layer {i}" for i in range(layers)}
    main = "".join(_hybrid_kind(keys, p, what) for p, what in prefixes.items())
    if depths and not sublayers:
        raise ValueError("the multi-token prediction modules of a hybrid model hold no "
                         "layers (mtp.layers.0.mtp_model_layer.layers.*)")  # fmt: skip
    module = "".join(_hybrid_kind(keys, p, f"multi-token prediction layer {j}")
                     for j, p in enumerate(sublayers))  # fmt: skip
    pattern = main + f"/{module}" * (depths or 0)
    prefixes = [*prefixes, *sublayers]
    mamba = [p for p, symbol in zip(prefixes, main + module, strict=True) if symbol == "M"]
    if not mamba:
        return {"hybrid_layer_pattern": pattern}
    mixer = mamba[0] + "mixer."
    (heads,) = reader.shape(mixer + "A_log")
    groups, rows, _ = reader.shape(mixer + "in_proj.z.weight")
    return {"hybrid_layer_pattern": pattern, "mamba_num_heads": heads,
            "mamba_head_dim": groups * rows // heads, "mamba_num_groups": groups,
            "mamba_state_dim": reader.shape(mixer + "in_proj.B.weight")[1]}  # fmt: skip


def _hybrid_kind(keys: list[str], prefix: str, what: str) -> str:
    """The symbol of the hybrid layer under `prefix`, by a tensor only its kind has."""
    kind = [symbol for name, symbol in _HYBRID_KINDS if prefix + name in keys]
    if len(kind) != 1:
        raise ValueError(f"{what} holds no tensors of one hybrid layer kind (a Mamba mixer, "
                         "attention, an MLP or experts)")  # fmt: skip
    return kind[0]


def _mla_from_tensors(reader: TensorSource, keys: list[str], settings: dict) -> dict:
    """Multi-latent attention's widths from its tensors, given the number of heads n:
    linear_kv_down_proj [r + dr, h], linear_kv_up_proj [n (dn + dv), r], the query
    projection [n (dn + dr), h or q_lora_rank], linear_proj [h, n dv]; and its sparse
    attention's indexer, where it has one."""
    heads = settings.get("num_attention_heads")
    if not heads:
        raise ValueError("model_config has no num_attention_heads: the tensors of multi-latent "
                         "attention do not show it")  # fmt: skip
    latent, h = reader.shape(f"{_MLA}linear_kv_down_proj.weight")
    kv_rows, r = reader.shape(f"{_MLA}linear_kv_up_proj.weight")
    q_lora = None
    if f"{_MLA}linear_q_proj.weight" in keys:
        q_rows = reader.shape(f"{_MLA}linear_q_proj.weight")[0]
    else:
        q_rows, q_lora = reader.shape(f"{_MLA}linear_q_up_proj.weight")
    v_cols = reader.shape(f"{_MLA}linear_proj.weight")[1]
    if q_rows % heads or kv_rows % heads or v_cols % heads:
        raise ValueError(
            f"num_attention_heads={heads} does not divide the multi-latent attention's "
            f"query ({q_rows}), key/value ({kv_rows}) or output ({v_cols}) rows"
        )
    dr = latent - r
    dn, dv = q_rows // heads - dr, v_cols // heads
    if dn < 1 or dn + dv != kv_rows // heads:
        raise ValueError(
            f"the multi-latent attention's tensors disagree: {heads} heads of {q_rows // heads} "
            f"query, {kv_rows // heads} key/value and {dv} value channels with "
            f"{dr} rotary channels"
        )
    shown = {"multi_latent_attention": True, "num_attention_heads": heads,
             "num_query_groups": heads, "hidden_size": h, "q_lora_rank": q_lora,
             "kv_lora_rank": r, "qk_head_dim": dn, "qk_pos_emb_head_dim": dr, "v_head_dim": dv,
             "qk_layernorm": f"{_MLA}kv_layernorm.weight" in keys}  # fmt: skip
    if f"{_INDEXER}linear_wk.weight" in keys:  # DeepSeek's sparse attention: wk [di, h],
        # weights_proj [Hi, h] (its top k the tensors do not show)
        shown |= {"experimental_attention_variant": "dsa",
                  "dsa_indexer_head_dim": reader.shape(f"{_INDEXER}linear_wk.weight")[0],
                  "dsa_indexer_n_heads":
                      reader.shape(f"{_INDEXER}linear_weights_proj.weight")[0]}  # fmt: skip
    return shown


def _check_layer_kinds(fam: Family, settings: dict) -> None:
    """Refuses a hybrid model with a kind of layer the family has no names for."""
    pattern = settings.get("hybrid_layer_pattern") or ""
    for symbol in sorted(set(pattern) - set("/|")):
        scope = HYBRID_SCOPES.get(symbol)
        if scope is None or not fam.rules_for(scope, settings):
            raise ValueError(f"model_config hybrid_layer_pattern={pattern!r}: {fam.model_type} "
                             f"has no {scope or symbol} layers ({symbol!r})")  # fmt: skip


def _shapes(reader: TensorSource, keys: list[str], settings: dict) -> dict:
    """What a family's config writer reads from the tensors."""
    vocab, h = reader.shape("embedding.word_embeddings.weight")
    layers = settings["num_layers"]
    moe = [is_moe_layer(settings, i) for i in range(layers)]
    shapes = {"vocab": vocab, "hidden": h, "layers": layers,
              "heads": settings["num_attention_heads"], "groups": settings["num_query_groups"],
              "head_dim": settings.get("kv_channels") or h // settings["num_attention_heads"],
              "tied": not settings["untie_embeddings_and_output_weights"],
              "sparse": [int(m) for m in moe]}  # fmt: skip
    if "embedding.position_embeddings.weight" in keys:
        shapes["positions"] = reader.shape("embedding.position_embeddings.weight")[0]
    # (a hybrid model's MLP or experts may be its multi-token prediction modules' alone)
    sublayers = _mtp_sublayers(keys)
    dense = [p for p in [f"decoder.layers.{i}." for i in range(layers)] + sublayers
             if f"{p}mlp.linear_fc2.weight" in keys]  # fmt: skip
    if dense:  # (every layer but an expert layer, unless the model is hybrid)
        shapes["ffn"] = reader.shape(_fc1(keys, f"{dense[0]}mlp.linear_fc1."))[0]
    experts = [f"decoder.layers.{i}." for i in range(layers) if moe[i]]
    experts += [p for p in sublayers if f"{p}mlp.router.weight" in keys]
    if experts:
        first = f"{experts[0]}mlp."
        shapes["experts"], shapes["expert_ffn"], _ = reader.shape(
            _fc1(keys, first + "experts.linear_fc1."))  # fmt: skip
        shared = _fc1(keys, first + "shared_experts.linear_fc1.")
        if shared in keys:
            shapes["shared_ffn"] = reader.shape(shared)[0]
    return shapes


def _fc1(keys: list[str], module: str) -> str:
    """The weight of an fc1 that shows its width: a gated one's gate, else its own."""
    return module + ("gate.weight" if module + "gate.weight" in keys else "weight")


def _plan(
    fam: Family, reader: TensorSource, settings: dict, dtype: torch.dtype | None = None
) -> dict[str, tuple[tuple, Producer]]:
    """{Hugging Face name: (the mp keys it reads, produce())} in the export's order; each
    tensor produced in `dtype` (None: as saved) unless its rule keeps its dtype."""
    dims = Dims.of(settings)
    plan: dict[str, tuple[tuple, Producer]] = {}

    def add(rule: Rule, layer: int | None, prefix: str) -> None:
        sources = tuple(name if rule.model_copy else prefix + name for name in rule.mp)
        names = [n.replace("{i}", str(layer)) for n in rule.hf_names]
        cast = dtype if not rule.keep_dtype else None
        if rule.per_expert:
            (source,), (name,) = sources, names
            for e in range(reader.shape(source)[0]):
                one = lambda s=source, e=e, r=rule: r.export([_expert(reader, s, e)], dims)[0]  # noqa: E731
                plan[name.replace("{e}", str(e))] = (sources, _cast(one, cast))
            return
        outputs = _shared_outputs(rule, [lambda s=s: reader.read(s) for s in sources], dims)
        for j, name in enumerate(names):
            plan[name] = (sources, _cast(lambda j=j: outputs(j), cast))

    model_rules = fam.rules_for("model", settings)
    for rule in (r for r in model_rules if r.mp[0].startswith("embedding.")):
        add(rule, None, "")
    for rule, layer, prefix in placed_rules(fam, settings):
        add(rule, layer, prefix)
    for rule in (r for r in model_rules if not r.mp[0].startswith("embedding.")):
        add(rule, None, "")
    return plan


def _cast(produce: Producer, dtype: torch.dtype | None) -> Producer:
    return produce if dtype is None else lambda: produce().to(dtype)


def _shared_outputs(rule: Rule, reads: list[Producer], dims: Dims) -> Callable[[int], torch.Tensor]:
    """output(j): the rule's j-th Hugging Face tensor, its sources read once for all of them
    and dropped once each output was taken."""
    cache: dict[int, torch.Tensor] = {}

    def output(j: int) -> torch.Tensor:
        if not cache:
            cache.update(enumerate(rule.export([read() for read in reads], dims)))
        return cache.pop(j)

    return output


def _expert(reader: TensorSource, key: str, e: int) -> torch.Tensor:
    """Expert e's slice of the stacked tensor `key`, reading only that slice."""
    shape = reader.shape(key)
    return reader.read(key, Region((e,) + (0,) * (len(shape) - 1), (1, *shape[1:])))[0]


def _check_keys(arch: str, keys: list[str], plan: dict, where: str) -> None:
    """Raises unless the checkpoint's model tensors are exactly those the family's rules
    read."""
    needed = {source for sources, _ in plan.values() for source in sources}
    extra, missing = sorted(set(keys) - needed), sorted(needed - set(keys))
    for what, names in (("has no place for", extra), ("needs, and the checkpoint lacks", missing)):
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise ValueError(f"{where}: the {arch} export {what} {shown}")


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()
