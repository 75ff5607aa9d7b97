"""Where each logical tensor of a Megatron-style GPT lives in a TP x PP layout.

The offline converter cuts logical tensors for a target layout without model
code, from their names (mp-layers' logical names, Megatron's module names):

    name ends with                                 split over tensor-parallel ranks
    linear_qkv.{q,k,v}.{weight,bias}               axis 0 (query groups)
    linear_fc1.weight / .bias, linear_fc1.{gate,up}.*   axis 0 (output features)
    linear_proj.weight, linear_fc2.weight          axis 1 (input features)
    word_embeddings.weight, output_layer.weight    axis 0 (vocabulary)
    anything else (norms, row-parallel biases,     whole on every rank
    position embeddings)

`decoder.layers.<i>.` belongs to the pipeline stage holding layer i; the
embeddings to the first stage; the final norm and the output layer to the
last. Optimizer states ("optimizer.<state>.<key>") follow their key.
"""

from __future__ import annotations

import re

__all__ = ["layer_index", "model_key", "stage_of", "tp_axis"]

_COLUMN = (
    re.compile(r"linear_qkv\.[qkv]\.(weight|bias)$"),
    re.compile(r"linear_fc1\.((gate|up)\.)?(weight|bias)$"),
    re.compile(r"(word_embeddings|output_layer)\.weight$"),
)
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")
_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
_OPTIMIZER = re.compile(r"^optimizer\.[A-Za-z0-9_]+\.")


def model_key(key: str) -> str:
    """The model tensor a key describes (strips "optimizer.<state>.")."""
    return _OPTIMIZER.sub("", key, count=1)


def tp_axis(key: str) -> int | None:
    """The axis split over tensor-parallel ranks, or None when every rank holds it whole."""
    name = model_key(key)
    if any(p.search(name) for p in _COLUMN):
        return 0
    if _ROW.search(name):
        return 1
    return None


def layer_index(key: str) -> int | None:
    match = _LAYER.search(model_key(key))
    return int(match.group(1)) if match else None


def stage_of(key: str, layer_stages: list[int], pp: int) -> list[int]:
    """The pipeline stages holding `key` (layer_stages[i]: the stage of layer i).

    The embeddings belong to the first stage. (With tied embeddings the last
    stage holds a copy of the word embedding, which loading fills from the
    same logical tensor: it needs no pieces of its own.)
    """
    name = model_key(key)
    index = layer_index(key)
    if index is not None:
        if index >= len(layer_stages):
            raise ValueError(f"{key}: layer {index}, but the checkpoint has {len(layer_stages)}")
        return [layer_stages[index]]
    if name.startswith("embedding."):
        return [0]
    if name.startswith(("decoder.final_layernorm", "output_layer")):
        return [pp - 1]
    raise ValueError(f"{key}: no pipeline stage is known for this tensor")
