"""Parse and validate memory budgets. Inside fxremat a budget is an int of bytes.

Accepted forms, parsed once at the edge:
- ``None``: no memory target (the least peak within ``time_slack`` of the fastest plan's time);
- a positive ``int`` number of bytes (``2 * 2**30``);
- a string with a unit, SI or IEC, case-insensitive: ``"512MiB"``, ``"1.5GB"``,
  ``"2GiB"``, ``"800kB"``, ``"1e9B"``; a bare number string is bytes.
"""

from __future__ import annotations

import math
import os
import re

from ._torch_compat import ShortenTraceback

__all__ = ["parse_budget", "budget_from_env", "format_bytes", "ENV_BUDGET", "BudgetError"]

ENV_BUDGET = "FXREMAT_BUDGET"

# SI units are powers of 1000, IEC units powers of 1024 (IEC 80000-13).
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_FORMS = 'a positive int of bytes, or a string with a unit such as "512MiB", "1.5GB", "2GiB" or "800kB" (SI: kB MB GB TB; IEC: KiB MiB GiB TiB), or None for no limit'


class BudgetError(ValueError, ShortenTraceback):
    """The budget is below the least peak any plan reaches.

    A ``ValueError``. (It also derives from Dynamo's ``ShortenTraceback`` only so
    that ``torch.compile`` lets it through unwrapped.)

    Attributes:
        budget: the budget asked for, in bytes.
        least_peak: the least predicted peak fxremat found, in bytes.
        where: the graph it was planning ("" when not known).
        why: what sets that least peak, when fxremat knows (the logits of an unchunked loss).

    Example:
        >>> try:
        ...     fxremat.explain(model, x, budget="1MiB")
        ... except fxremat.BudgetError as e:
        ...     plan = fxremat.explain(model, x, budget=e.least_peak)   # the tightest plan that fits
    """

    def __init__(self, budget: int, least_peak: int, where: str = "", why: str = "") -> None:
        self.budget = budget
        self.least_peak = least_peak
        self.where = where
        self.why = why
        self.first_useful_frame = None
        place = f" for {where}" if where else ""
        ValueError.__init__(
            self,
            f"budget {budget} bytes ({format_bytes(budget)}) is below the least reachable peak{place}: "
            f"{least_peak} bytes ({format_bytes(least_peak)}). Raise the budget to at least "
            f"{format_bytes(least_peak)}, shrink the batch or sequence, or pass on_infeasible='min' "
            f"to use the least-memory plan with a warning." + (f" {why}" if why else ""),
        )

    def explained(self, why: str) -> "BudgetError":
        """The same error with ``why`` added to what it says sets the least peak."""
        return BudgetError(self.budget, self.least_peak, where=self.where, why=" ".join(filter(None, [self.why, why])))


def format_bytes(n: int) -> str:
    """Format a byte count with binary units.

    Args:
        n: Number of bytes (may be negative).

    Returns:
        ``"800 B"`` below 1 KiB; otherwise the largest unit (KiB, MiB, GiB,
        TiB) with a value of at least 1, with two decimals below 10 and one
        from 10 up.

    Example:
        >>> format_bytes(800), format_bytes(512 * 2**20), format_bytes(3 * 2**29)
        ('800 B', '512.0 MiB', '1.50 GiB')
    """
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    digits = 2 if value < 10 else 1
    return f"{sign}{value:.{digits}f} {unit}"


def parse_budget(value: object, *, name: str = "budget") -> int | None:
    """Turn a user's budget into an int of bytes.

    Args:
        value: ``None``, a positive int of bytes, or a string with a unit.
        name: what to call the value in error messages (an option or variable name).

    Returns:
        The budget in bytes, or None for no limit.

    Raises:
        TypeError: for a bool, float or other type.
        ValueError: for zero, negative, NaN or unparseable values.

    Example:
        >>> parse_budget("1.5GiB")
        1610612736
        >>> parse_budget("800kB")
        800000
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} is a bool; expected {_FORMS}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be positive; expected {_FORMS}")
        return value
    if isinstance(value, float):
        hint = (
            " A float in (0, 1] looks like a fraction of memory; fxremat budgets are bytes." if 0 < value <= 1 else ""
        )
        raise TypeError(f"{name}={value!r} is a float; expected {_FORMS}.{hint}")
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} has type {type(value).__name__}; expected {_FORMS}")
    match = _PATTERN.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={value!r} cannot be parsed; expected {_FORMS}")
    number = float(match.group(1))
    nbytes = number * _UNITS[match.group(2).lower()]
    if not math.isfinite(nbytes):
        raise ValueError(f"{name}={value!r} is too large to be a number of bytes; expected {_FORMS}")
    if nbytes < 1:
        raise ValueError(f"{name}={value!r} must be at least one byte; expected {_FORMS}")
    return int(nbytes)


def budget_from_env() -> int | None:
    """The budget in ``FXREMAT_BUDGET``, or None when unset or empty."""
    raw = os.environ.get(ENV_BUDGET, "").strip()
    if not raw:
        return None
    return parse_budget(raw, name=f"environment variable {ENV_BUDGET}")
