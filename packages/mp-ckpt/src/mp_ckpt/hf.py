"""Hugging Face GPT-2, Llama, Mixtral and Qwen2-MoE <-> mp's logical tensors: slicing
and renaming only.

Logical names are mp-layers' (Megatron's module names, fused tensors as their
parts). The query heads of group g are q[g] ([groups, heads per group, head
dim, hidden]); Hugging Face orders heads the same way (head j uses key/value
head j // (heads / groups)) and both rotate channel pairs (i, i + d/2), so
q_proj is q flattened. GPT-2's Conv1D weights are [in, out]: transposed.
Mixtral and Qwen2-MoE are Llama's attention and norms with mixture-of-experts
layers (hf_moe); Qwen2-MoE adds q/k/v biases.

    export_hf(checkpoint_dir, out_dir, arch)    config.json + model.safetensors (sharded
                                                with an index above max_shard_bytes),
                                                tokenizer files, generation_config.json
    import_hf(hf_dir, out_root)                 an mp checkpoint at iteration 0

config.json's mapping is hf_config's (hf_moe_config's for the experts); the
tokenizer's, hf_tokenizer's.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mp_ckpt.hf_config import gpt2_config, llama_config, model_config_from_hf
from mp_ckpt.hf_moe import export_moe_mlp, import_moe_mlp, is_moe_layer, moe_mlp_keys
from mp_ckpt.hf_moe_config import (
    ARCHITECTURES,
    mixtral_config,
    moe_topk,
    qwen2_moe_config,
)
from mp_ckpt.hf_tokenizer import (
    TOKENIZER_FILES,
    export_tokenizer,
    generation_config,
    tokenizer_from_hf,
    write_atomically,
)
from mp_ckpt.progress import progress as progress_reporter
from mp_ckpt.reader import CheckpointReader
from mp_ckpt.safetensors_writer import ShardedSafetensorsWriter

__all__ = [
    "ARCHITECTURES",
    "export_hf",
    "import_hf",
    "logical_from_hf",
    "model_config_from_hf",
]

_DEFAULT_SHARD_BYTES = 5 * 2**30

# Per-layer tensors that only change names (Hugging Face -> mp): attention and norms,
# then a dense (not mixture-of-experts) MLP.
_LLAMA_PER_LAYER = {
    "self_attn.o_proj": "self_attention.linear_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "pre_mlp_layernorm",
}
_LLAMA_MLP = {
    "mlp.gate_proj": "mlp.linear_fc1.gate",
    "mlp.up_proj": "mlp.linear_fc1.up",
    "mlp.down_proj": "mlp.linear_fc2",
}
# GPT-2's Conv1D layers (weights [in, out], transposed on the way) -> mp's linear layers.
_GPT2_CONV1D = {
    "attn.c_proj": "self_attention.linear_proj",
    "mlp.c_fc": "mlp.linear_fc1",
    "mlp.c_proj": "mlp.linear_fc2",
}


def _layers(keys) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


# --- export ------------------------------------------------------------------------------


# Settings neither export computes (Nemotron's and gpt-oss's; no family table has them yet).
_NOT_EXPORTED = (("apply_layernorm_1p", False), ("quick_geglu", False),
                 ("glu_linear_offset", 0.0), ("activation_func_clamp_value", None))  # fmt: skip


def export_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    arch: str,
    *,
    iteration: int | None = None,
    max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Path:
    """Writes a Hugging Face directory that transformers loads (GPT2LMHeadModel,
    LlamaForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM): the safetensors, the
    tokenizer files (hf_tokenizer), generation_config.json when a special token id is
    known, and config.json last.
    Settings the tensors do not show (norm epsilon, activation, rotary base and
    scaling, ...) come from the checkpoint's common["model_config"] (Megatron names),
    completed by common["config"]["model"] (the training run's TransformerConfig).
    progress: report the tensors written on stderr (progress.py)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    reader = CheckpointReader(checkpoint, iteration=iteration)
    model_keys = [k for k in reader.keys if not k.startswith("optimizer.")]
    common = torch.load(reader.directory / "common.pt", weights_only=False)
    common = common if isinstance(common, dict) else {}
    # A checkpoint saved by mp's training also holds the run's whole model config
    # (TransformerConfig's fields: activation details, rotary scaling, ...).
    run_model = (common.get("config") or {}).get("model") or {}
    settings = dict(run_model) | dict(common.get("model_config") or {})
    _check_keys(arch, model_keys, reader.directory)
    if arch != "gpt2" and settings.get("rotary_percent", 1.0) != 1.0:
        raise ValueError(
            f"model_config rotary_percent={settings['rotary_percent']!r}: the {arch} export "
            "rotates every channel of a head"
        )
    for name, plain in _NOT_EXPORTED:
        if settings.get(name, plain) not in (plain, None):
            raise ValueError(f"model_config {name}={settings[name]!r}: the {arch} export "
                             f"computes {name}={plain!r}")  # fmt: skip
    files, ids = export_tokenizer(common)
    saved_dtype = reader.dtype("embedding.word_embeddings.weight")
    dtype_name = str(dtype or saved_dtype).removeprefix("torch.")
    if arch == "gpt2":
        config, tensors = _gpt2_export(reader, model_keys, settings, ids, dtype_name)
    else:
        config, tensors = _llama_export(arch, reader, model_keys, settings, ids, dtype_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with progress_reporter(None, "export-hf", unit="tensor", enabled=progress) as bar:
        _write_safetensors(out, tensors, max_shard_bytes, dtype, bar.update)
    for name, data in files.items():
        if name not in TOKENIZER_FILES:
            raise ValueError(f"common['tokenizer'] names a file {name!r}, not a tokenizer file")
        write_atomically(out / name, data)
    generation = generation_config(common, ids)
    if generation is not None:
        write_atomically(out / "generation_config.json", _json(generation))
    write_atomically(out / "config.json", _json(config))
    return out


def _check_keys(arch: str, keys: list[str], directory: Path) -> None:
    """Raises unless the model tensors are exactly those `arch` has a place for (a Llama's
    output_layer.weight is optional: absent, the output is tied to the embedding)."""
    if arch == "gpt2":
        parts = [f"self_attention.linear_qkv.{p}" for p in "qkv"]
        parts += [*_GPT2_CONV1D.values(), "input_layernorm", "pre_mlp_layernorm"]
        per_layer = [f"{part}.{w}" for part in parts for w in ("weight", "bias")]
        fixed = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                 "decoder.final_layernorm.weight", "decoder.final_layernorm.bias"}  # fmt: skip
    else:
        parts = [f"self_attention.linear_qkv.{p}" for p in "qkv"] + list(_LLAMA_PER_LAYER.values())
        per_layer = [f"{part}.weight" for part in parts]
        if arch == "qwen2_moe" and "decoder.layers.0.self_attention.linear_qkv.q.bias" in keys:
            per_layer += [f"self_attention.linear_qkv.{p}.bias" for p in "qkv"]
        fixed = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    layers = _layers(keys)
    needed = fixed | {f"decoder.layers.{i}.{k}" for i in range(layers) for k in per_layer}
    if arch != "gpt2":
        dense = [f"{part}.weight" for part in _LLAMA_MLP.values()]
        shared = arch == "qwen2_moe"
        for i in range(layers):
            # Mixtral's layers are all MoE; a Qwen2-MoE layer is MoE where it has a router.
            moe = arch == "mixtral" or (shared and f"decoder.layers.{i}.mlp.router.weight" in keys)
            needed |= {f"decoder.layers.{i}.{k}" for k in (moe_mlp_keys(shared) if moe else dense)}
    extra = sorted(set(keys) - needed - {"output_layer.weight"})  # gpt2's: refused later
    missing = sorted(needed - set(keys))
    for what, names in (("has no place for", extra), ("needs, and the checkpoint lacks", missing)):
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise ValueError(f"{directory}: the {arch} export {what} {shown}")


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def _gpt2_export(reader: CheckpointReader, keys: list[str], settings: dict, ids: dict,
                 dtype: str):  # fmt: skip
    if "output_layer.weight" in keys:
        raise ValueError(
            "GPT2LMHeadModel ties its output layer to the embedding; this checkpoint has a "
            "separate output_layer.weight: export it as llama"
        )
    vocab, h = reader.shape("embedding.word_embeddings.weight")
    positions = reader.shape("embedding.position_embeddings.weight")[0]
    layers = _layers(keys)
    heads, per_group = reader.shape("decoder.layers.0.self_attention.linear_qkv.q.weight")[:2]
    if per_group != 1:
        raise ValueError(
            f"{reader.directory}: grouped-query attention ({per_group} query heads per group); "
            "GPT-2 has one key/value head per query head: export it as llama"
        )
    ffn = reader.shape("decoder.layers.0.mlp.linear_fc1.weight")[0]
    shapes = {"vocab": vocab, "positions": positions, "hidden": h, "layers": layers,
              "heads": heads, "ffn": ffn}  # fmt: skip
    config = gpt2_config(settings, shapes, ids, dtype)

    def tensors() -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        read = reader.read
        yield "transformer.wte.weight", lambda: read("embedding.word_embeddings.weight")
        yield "transformer.wpe.weight", lambda: read("embedding.position_embeddings.weight")
        for i in range(layers):
            src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
            qkv = src + "self_attention.linear_qkv."
            yield (
                dst + "attn.c_attn.weight",
                lambda q=qkv: (
                    torch.cat([read(q + p + ".weight").reshape(h, h) for p in "qkv"])
                    .t()
                    .contiguous()
                ),
            )
            yield (
                dst + "attn.c_attn.bias",
                lambda q=qkv: torch.cat([read(q + p + ".bias").reshape(h) for p in "qkv"]),
            )
            for theirs, ours in _GPT2_CONV1D.items():
                yield (
                    dst + theirs + ".weight",
                    lambda k=src + ours: read(k + ".weight").t().contiguous(),
                )
                yield dst + theirs + ".bias", lambda k=src + ours: read(k + ".bias")
            for theirs, ours in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                for part in ("weight", "bias"):
                    yield f"{dst}{theirs}.{part}", lambda k=f"{src}{ours}.{part}": read(k)
        for part in ("weight", "bias"):
            yield f"transformer.ln_f.{part}", lambda p=part: read(f"decoder.final_layernorm.{p}")

    return config, tensors()  # fmt: skip


def _llama_export(arch: str, reader: CheckpointReader, keys: list[str], settings: dict,
                  ids: dict, dtype: str):  # fmt: skip
    """Llama, and the Llama-style Mixtral and Qwen2-MoE (whose MoE layers hf_moe maps)."""
    vocab, h = reader.shape("embedding.word_embeddings.weight")
    layers = _layers(keys)
    groups, per_group, d, _ = reader.shape("decoder.layers.0.self_attention.linear_qkv.q.weight")
    moe = [f"decoder.layers.{i}.mlp.router.weight" in keys for i in range(layers)]
    qkv_bias = "decoder.layers.0.self_attention.linear_qkv.q.bias" in keys
    dense = [i for i in range(layers) if not moe[i]]
    tied = "output_layer.weight" not in keys
    shapes = {"vocab": vocab, "hidden": h, "layers": layers, "heads": groups * per_group,
              "groups": groups, "head_dim": d, "tied": tied}  # fmt: skip
    if dense:
        shapes["ffn"] = reader.shape(f"decoder.layers.{dense[0]}.mlp.linear_fc1.gate.weight")[0]
    experts = 0
    if arch == "llama":
        config = llama_config(settings, shapes, ids, dtype)
    else:
        if not any(moe):
            raise ValueError(
                f"{reader.directory}: no layer has an mlp.router.weight: a dense model, "
                "export it as llama"
            )
        first = f"decoder.layers.{moe.index(True)}.mlp."
        experts, expert_ffn, _ = reader.shape(first + "experts.linear_fc1.gate.weight")
        shapes |= {"experts": experts, "expert_ffn": expert_ffn,
                   "topk": moe_topk(settings, arch), "sparse": [int(m) for m in moe],
                   "qkv_bias": qkv_bias}  # fmt: skip
        if arch == "mixtral":
            config = mixtral_config(settings, shapes, ids, dtype)
        else:
            shapes["shared_ffn"] = reader.shape(first + "shared_experts.linear_fc1.gate.weight")[0]
            shapes.setdefault("ffn", settings.get("ffn_hidden_size") or expert_ffn)
            config = qwen2_moe_config(settings, shapes, ids, dtype)

    def tensors() -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        read = reader.read
        yield "model.embed_tokens.weight", lambda: read("embedding.word_embeddings.weight")
        for i in range(layers):
            src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
            qkv = src + "self_attention.linear_qkv."
            for p in "qkv":
                yield f"{dst}self_attn.{p}_proj.weight", lambda k=f"{qkv}{p}.weight": read(
                    k).reshape(-1, h)  # fmt: skip
                if qkv_bias:
                    yield f"{dst}self_attn.{p}_proj.bias", lambda k=f"{qkv}{p}.bias": read(
                        k).reshape(-1)  # fmt: skip
            for theirs, ours in _LLAMA_PER_LAYER.items():
                yield f"{dst}{theirs}.weight", lambda k=f"{src}{ours}.weight": read(k)
            if moe[i]:
                yield from export_moe_mlp(reader, arch, src, dst, experts, arch == "qwen2_moe")
                continue
            for theirs, ours in _LLAMA_MLP.items():
                yield f"{dst}{theirs}.weight", lambda k=f"{src}{ours}.weight": read(k)
        yield "model.norm.weight", lambda: read("decoder.final_layernorm.weight")
        if not tied:
            yield "lm_head.weight", lambda: read("output_layer.weight")

    return config, tensors()


def _write_safetensors(out: Path, tensors, max_shard_bytes: int, dtype, written) -> None:
    """One tensor in memory at a time (ShardedSafetensorsWriter); written() after each."""
    with ShardedSafetensorsWriter(out, max_shard_bytes) as writer:
        for name, produce in tensors:
            tensor = produce()
            writer.add(name, tensor if dtype is None else tensor.to(dtype))
            written()


# --- import ------------------------------------------------------------------------------


def import_hf(hf_dir: str | os.PathLike, out_root: str | os.PathLike, *,
              progress: bool = False) -> Path:  # fmt: skip
    """Writes an mp checkpoint (iteration 0, model only) from a local Hugging Face
    GPT-2, Llama, Mixtral or Qwen2-MoE directory (config.json with safetensors or
    pytorch_model.bin).
    common.pt holds the model's settings (Megatron names), the folder's tokenizer
    files and special token ids, and its generation_config.json (hf_tokenizer).
    progress: report the weight files read on stderr (progress.py)."""
    from mp_ckpt.checkpointer import Checkpointer
    from mp_ckpt.layout import checkpoint_dir
    from mp_ckpt.sharding import ShardedTensor

    hf_dir = Path(hf_dir)
    config = _read_json(hf_dir / "config.json", "not a Hugging Face model directory")
    model_config = model_config_from_hf(config)
    generation = None
    if (hf_dir / "generation_config.json").exists():
        generation = _read_json(hf_dir / "generation_config.json", "")
    state = _read_hf_state(hf_dir, progress)
    logical = logical_from_hf(state, config)
    pieces = {
        k: ShardedTensor(k, t.contiguous(), tuple(t.shape), (0,) * t.dim())
        for k, t in logical.items()
    }
    common = {"iteration": 0, "model_config": model_config, "imported_from": str(hf_dir),
              "tokenizer": tokenizer_from_hf(hf_dir, config, generation)}  # fmt: skip
    if generation is not None:
        common["generation_config"] = generation
    Checkpointer(out_root).save(0, pieces, common=common)
    return checkpoint_dir(out_root, 0)


def _read_json(path: Path, missing: str) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {missing}")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def logical_from_hf(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """mp's logical tensors from a Hugging Face state dict and its config.json (as a dict).
    Mixtral's and Qwen2-MoE's experts may be per expert or fused (hf_moe)."""
    model_config_from_hf(config)  # rejects unknown model types
    if config["model_type"] == "gpt2":
        return _gpt2_import(state, config)
    return _llama_import(state, config)


def _read_hf_state(hf_dir: Path, progress: bool = False) -> dict[str, torch.Tensor]:
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


def _take(state: dict, name: str) -> torch.Tensor:
    for candidate in (name, name.removeprefix("transformer.")):
        if candidate in state:
            return state[candidate]
    raise KeyError(f"the Hugging Face weights have no tensor {name!r}")


def _gpt2_import(state: dict, config: dict) -> dict[str, torch.Tensor]:
    h, heads, layers = config["n_embd"], config["n_head"], config["n_layer"]
    d = h // heads
    out = {
        "embedding.word_embeddings.weight": _take(state, "transformer.wte.weight"),
        "embedding.position_embeddings.weight": _take(state, "transformer.wpe.weight"),
        "decoder.final_layernorm.weight": _take(state, "transformer.ln_f.weight"),
        "decoder.final_layernorm.bias": _take(state, "transformer.ln_f.bias"),
    }
    for i in range(layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        qkv_w = _take(state, src + "attn.c_attn.weight").t()
        qkv_b = _take(state, src + "attn.c_attn.bias")
        for part, w, b in zip("qkv", qkv_w.chunk(3), qkv_b.chunk(3), strict=True):
            shape = (heads, 1, d) if part == "q" else (heads, d)
            out[f"{dst}self_attention.linear_qkv.{part}.weight"] = w.reshape(*shape, h)
            out[f"{dst}self_attention.linear_qkv.{part}.bias"] = b.reshape(shape)
        for theirs, ours in _GPT2_CONV1D.items():
            out[f"{dst}{ours}.weight"] = _take(state, f"{src}{theirs}.weight").t()
            out[f"{dst}{ours}.bias"] = _take(state, f"{src}{theirs}.bias")
        for theirs, ours in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            for part in ("weight", "bias"):
                out[f"{dst}{ours}.{part}"] = _take(state, f"{src}{theirs}.{part}")
    return out


def _llama_import(state: dict, config: dict) -> dict[str, torch.Tensor]:
    settings = model_config_from_hf(config)
    h, heads = settings["hidden_size"], settings["num_attention_heads"]
    groups, d = settings["num_query_groups"], settings["kv_channels"]
    arch = config["model_type"]
    out = {
        "embedding.word_embeddings.weight": _take(state, "model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": _take(state, "model.norm.weight"),
    }
    if settings["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = _take(state, "lm_head.weight")
    shapes = {"q": (groups, heads // groups, d), "k": (groups, d), "v": (groups, d)}
    for i in range(settings["num_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = f"{dst}self_attention.linear_qkv."
        for p, shape in shapes.items():
            out[f"{qkv}{p}.weight"] = _take(state, f"{src}self_attn.{p}_proj.weight").reshape(
                *shape, h)  # fmt: skip
            if settings.get("add_qkv_bias"):
                out[f"{qkv}{p}.bias"] = _take(state, f"{src}self_attn.{p}_proj.bias").reshape(shape)
        for theirs, ours in _LLAMA_PER_LAYER.items():
            out[f"{dst}{ours}.weight"] = _take(state, f"{src}{theirs}.weight")
        if is_moe_layer(settings, i):
            shared = settings.get("moe_shared_expert_intermediate_size") is not None
            moe = import_moe_mlp(state, arch, src, settings["num_moe_experts"], shared)
            out |= {dst + k: v for k, v in moe.items()}
            continue
        for theirs, ours in _LLAMA_MLP.items():
            out[f"{dst}{ours}.weight"] = _take(state, f"{src}{theirs}.weight")
    return out
