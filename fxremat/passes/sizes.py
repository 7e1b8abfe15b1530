"""A dynamic graph's symbolic sizes under a budget: capped at the sizes it is planned at, or fixed.

A graph Dynamo traced with symbolic sizes (a second sequence length, ``dynamic=True``)
runs at any size its guards admit, and a budget is a promise about every step that
runs. fxremat plans it at its current sizes (every size read at its hint), then:

- **caps** each input size at its current value (a guard ``size <= current``) when every
  tensor of the graph grows with its sizes, none shrinking as one grows: each tensor the
  programs hold at a shorter length is no larger, the programs and their order the same,
  so a plan that fits at the sizes it was made for fits at every smaller one. Dynamo then
  compiles again only at a size larger than any compiled so far;
- **fixes** each at its current value (a guard ``size == current``) otherwise: a tensor
  whose size falls as an input size grows (``x[:, k:]`` of a symbolic ``k``), an integer
  input that is not a size, a size expression this module cannot tell grows.

With no budget nothing is guarded: one plan, made at the first dynamic sizes, runs every size.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_bool, guard_int

from .opinfo import alias_source, size_hint

__all__ = ["CAPPED", "FIXED", "bound_sizes", "cappable", "fix_sizes", "grows_with_sizes", "symbolic_sizes"]

CAPPED = "capped"
"""``bound_sizes``: each symbolic input size guarded to at most its current value."""
FIXED = "fixed"
"""``bound_sizes``: each symbolic input size guarded to its current value."""


def symbolic_sizes(gm: fx.GraphModule, key: str = "val") -> list[torch.SymInt]:
    """Every symbolic size, stride and storage offset of ``gm``'s inputs (``meta[key]``: "val" in
    AOTAutograd's graphs, "example_value" in Dynamo's), and its symbolic-int inputs, less those fixed."""
    sizes: list[torch.SymInt] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get(key)
        if isinstance(val, torch.Tensor):
            sizes += [d for d in (*val.shape, *val.stride(), val.storage_offset()) if _free(d)]
        elif _free(val):
            sizes.append(val)
    return sizes


def _free(d) -> bool:
    """Whether ``d`` is a symbolic size not yet fixed (a guard may have made its symbols one value)."""
    return isinstance(d, torch.SymInt) and bool(d.node.expr.free_symbols)


def _grows(expr: sympy.Expr) -> bool:
    """Whether ``expr``, a size in positive symbols, never falls as any of them grows (a sufficient test).

    A sum of terms, each a positive constant times a product of symbols, their powers, and
    floor or ceiling divisions of such sums by positive constants; a constant term of any sign.
    """
    expr = sympy.expand(expr)
    for term in sympy.Add.make_args(expr):
        coeff, rest = term.as_coeff_Mul()
        if rest == 1:
            continue  # a constant shifts the size, it does not make it fall
        if not coeff > 0:
            return False
        for factor in sympy.Mul.make_args(rest):
            if not _grows_factor(factor):
                return False
    return True


def _grows_factor(factor: sympy.Expr) -> bool:
    if isinstance(factor, sympy.Symbol):
        return True
    if isinstance(factor, sympy.Pow):
        base, power = factor.args
        return isinstance(base, sympy.Symbol) and power.is_Integer and power > 0
    # FloorDiv / CeilDiv (torch.utils._sympy.functions) by a positive constant, of a size that grows.
    if type(factor).__name__ in ("FloorDiv", "CeilDiv", "CleanDiv") and len(factor.args) == 2:
        numerator, divisor = factor.args
        return divisor.is_Integer and divisor > 0 and _grows(numerator)
    return False


def grows_with_sizes(gm: fx.GraphModule, key: str = "val") -> bool:
    """Whether every tensor ``gm`` allocates (``meta[key]``) has a size that never falls as a symbolic size grows.

    A view allocates nothing (an op whose schema returns an input's storage: ``alias_source``):
    its size is not asked.

    Example:
        >>> grows_with_sizes(gm, "example_value")  # HF GPT-2 traced for any length: True
    """
    asked: dict[sympy.Expr, bool] = {}  # a graph's tensors share a few size expressions
    for node in gm.graph.nodes:
        if alias_source(node) is not None:
            continue
        val = node.meta.get(key)
        for t in val if isinstance(val, (tuple, list)) else (val,):
            if not isinstance(t, torch.Tensor):
                continue
            for d in t.shape:
                if isinstance(d, torch.SymInt):
                    expr = d.node.expr
                    if expr not in asked:
                        asked[expr] = _grows(expr)
                    if not asked[expr]:
                        return False
    return True


def _bare_sizes(gm: fx.GraphModule, key: str) -> dict[sympy.Symbol, torch.SymInt]:
    """Each symbol that is, alone, a size of one of ``gm``'s tensor inputs' shapes: the first such size."""
    bare: dict[sympy.Symbol, torch.SymInt] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get(key)
        for d in val.shape if isinstance(val, torch.Tensor) else ():
            if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                bare.setdefault(d.node.expr, d)
    return bare


def cappable(gm: fx.GraphModule, key: str = "val") -> bool:
    """Whether ``bound_sizes`` caps ``gm``'s symbolic sizes (asked without a guard): every tensor grows
    with them, and every symbol of its inputs is, alone, a size of one of their shapes (a product's
    cap would leave its factors free: ``s0 * s1 <= 512`` lets ``s0`` grow while ``s1`` falls)."""
    symbols = {s for d in symbolic_sizes(gm, key) for s in d.node.expr.free_symbols}
    return symbols <= _bare_sizes(gm, key).keys() and grows_with_sizes(gm, key)


def bound_sizes(gm: fx.GraphModule, key: str = "val", capped: bool | None = None) -> str | None:
    """Guard ``gm``'s symbolic sizes for a plan made at their current values: capped, else fixed.

    Capped (each input size at most its current value) where ``cappable``; else every
    symbolic size, stride, offset and integer input fixed at its current value.

    Args:
        gm: Dynamo's graph (``key="example_value"``) or AOTAutograd's (``key="val"``).
        key: the node meta holding each node's value.
        capped: ``cappable(gm, key)`` when the caller has asked it already.

    Returns:
        ``CAPPED``, ``FIXED``, or None when nothing is symbolic.

    Example:
        >>> bound_sizes(gm, "example_value")  # GPT-2 at 192 tokens: guard s0 <= 192
        'capped'
    """
    if not symbolic_sizes(gm, key):
        return None
    if cappable(gm, key) if capped is None else capped:
        bare = _bare_sizes(gm, key)
        for symbol in sorted(bare, key=str):
            guard_bool(bare[symbol] <= size_hint(bare[symbol]))
        return CAPPED
    fix_sizes(gm, key)
    return FIXED


def fix_sizes(gm: fx.GraphModule, key: str = "val") -> None:
    """Guard every symbolic size, stride, offset and integer input of ``gm``'s inputs to its current value."""
    for d in symbolic_sizes(gm, key):
        guard_int(d)
