"""passes/sizes.py: which size expressions never fall as a symbolic size grows."""

from __future__ import annotations

import pytest
import sympy
from torch.utils._sympy.functions import FloorDiv

from fxremat.passes.sizes import _grows

s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)


@pytest.mark.parametrize(
    "expr",
    [s0, s0 - 1, 2 * s0 * s1 + 3, s0**2, FloorDiv(s0 + 3, 4), 16 * FloorDiv(s0 * s1 + 15, 16), sympy.Integer(7)],
    ids=str,
)
def test_sizes_that_grow(expr):
    assert _grows(expr)


@pytest.mark.parametrize(
    "expr",
    [64 - s0, s1 - s0, sympy.Min(s0, 2 * FloorDiv(s0 + 3, 4)), sympy.Mod(s0, 4), FloorDiv(s0, s1)],
    ids=str,
)
def test_sizes_that_may_fall(expr):
    assert not _grows(expr)
