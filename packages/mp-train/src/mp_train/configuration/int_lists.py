"""Lists of integers written as Megatron-LM writes its layer patterns:

    --moe-layer-freq 2                 # one integer
    --moe-layer-freq "[1,0,1,0]"       # a list
    --moe-layer-freq "([0]+[1]*26)"    # a list expression: one dense layer, then 26 MoE

Megatron-LM (arguments.py, moe_freq_type) checks the characters and calls eval();
mp reads the same expressions with a small evaluator over Python's syntax tree that
knows integer literals, list literals, + and * (and parentheses), and refuses
anything else, so no code from a command line or a YAML file ever runs.
"""

from __future__ import annotations

import ast

__all__ = ["MAX_LENGTH", "parse_int_list", "parse_int_or_list"]

MAX_LENGTH = 1_000_000
"""The longest list an expression may build (a layer pattern has one entry per layer)."""

_FORM = (
    "an integer, or a Python list expression of integer lists, + and * such as "
    "([0]+[1]*3)*2 (Megatron-LM's layer pattern)"
)


def parse_int_list(text: str) -> list[int]:
    """The integers of `text`: [N] for an integer N, the list of a list expression;
    ValueError naming the text and what is allowed otherwise."""
    value = parse_int_or_list(text)
    return [value] if isinstance(value, int) else value


def parse_int_or_list(text: str) -> int | list[int]:
    """As Megatron-LM's moe_freq_type: N for an integer N (an integer expression), the
    list of a list expression; ValueError naming the text and what is allowed otherwise."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{text!r} is not {_FORM}") from None
    return _evaluate(tree.body, text)


def _evaluate(node: ast.AST, text: str) -> int | list[int]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_evaluate(item, text) for item in node.elts]
        if any(isinstance(item, list) for item in items):
            raise ValueError(f"{text!r}: a list inside a list; write {_FORM}")
        return _bounded(items, text)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        left, right = _evaluate(node.left, text), _evaluate(node.right, text)
        if isinstance(node.op, ast.Add):
            if isinstance(left, list) != isinstance(right, list):
                raise ValueError(f"{text!r}: + joins two lists or adds two integers")
            return _bounded(left + right, text) if isinstance(left, list) else left + right
        if isinstance(left, list) and isinstance(right, list):
            raise ValueError(f"{text!r}: * repeats a list an integer number of times")
        items, times = (left, right) if isinstance(left, list) else (right, left)
        if isinstance(items, list):
            if len(items) * max(times, 0) > MAX_LENGTH:
                raise ValueError(f"{text!r} builds a list longer than {MAX_LENGTH}")
            return items * times
        return left * right
    shown = ast.get_source_segment(text.strip(), node) or type(node).__name__
    raise ValueError(f"{text!r}: {shown!r} is not allowed; write {_FORM}")


def _bounded(items: list[int], text: str) -> list[int]:
    if len(items) > MAX_LENGTH:
        raise ValueError(f"{text!r} builds a list longer than {MAX_LENGTH}")
    return items
