"""All user options in one frozen, documented dataclass, validated at the edge."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Literal

from .budget import budget_from_env, parse_budget
from .hardware import HARDWARE
from .solvers.types import DEFAULT_TIME_LIMIT

__all__ = ["Options", "INNERS", "ON_INFEASIBLE", "ON_ERROR", "ENV_DUMP_DIR", "ENV_VERIFY"]

INNERS = ("inductor", "eager")
ON_INFEASIBLE = ("error", "min")
ON_ERROR = ("raise", "fallback")
ENV_DUMP_DIR = "FXREMAT_DUMP_DIR"
ENV_VERIFY = "FXREMAT_VERIFY"


def _solver_names() -> tuple[str, ...]:
    from .solvers.registry import SOLVERS

    return tuple(SOLVERS)


@dataclass(frozen=True)
class Options:
    """How fxremat plans and compiles a graph.

    Build it with ``Options.from_mapping`` (or ``fxremat.backend(...)``), which
    validates every value and reads ``FXREMAT_BUDGET`` / ``FXREMAT_DUMP_DIR``
    when the mapping gives none.
    """

    budget: int | None = None
    """Peak bytes of the step's activations, temporaries and gradients; None: no budget, the
    least-peak plan within ``time_slack`` of the fastest plan's estimated step time."""
    inner: Literal["inductor", "eager"] = "inductor"
    """Compiler for the planned forward and backward: Inductor, or eager fx code."""
    solver: str = "auto"
    """One of ``fxremat.solvers.SOLVERS``: auto, ilp, mincut, save_all, per_layer, sqrt_n, save_inputs."""
    hardware: str = "cpu"
    """Cost-model profile for time estimates: cpu, a100, h100, h200."""
    on_infeasible: Literal["error", "min"] = "error"
    """When no plan fits the budget: raise BudgetError, or use the least-memory plan and warn."""
    on_error: Literal["raise", "fallback"] = "raise"
    """When planning fails unexpectedly: raise, or fall back to PyTorch's partitioner and warn."""
    time_limit: float = DEFAULT_TIME_LIMIT
    """Safety net, in seconds, per solve: past it planning stops with ``SolveTimeout`` (raised,
    or PyTorch's partition with ``on_error="fallback"``). Plans never depend on it: solvers
    stop on work limits (``math.inf``: no safety net)."""
    dump_dir: str | None = None
    """Folder where each compiled graph's plan is saved (one subfolder per graph)."""
    measure_scratch: bool = True
    """Measure each distinct op's kernel workspace once on the graph's device (CPU or
    CUDA), so predictions include it; off, or on meta/fake graphs, workspace counts 0."""
    calibrate: bool = False
    """Time each distinct op of the joint graph once on the graph's device (a few reps,
    median) and use those times instead of the ``hardware`` roofline; ops that cannot
    run standalone (random, in-place, effectful) keep the roofline estimate."""
    release_outputs: bool | None = None
    """Whether the caller drops the forward's outputs before the backward (``loss =
    model(x).loss`` drops the logits; so does ``transformers.Trainer``). None (default):
    watch the first step; outputs count as alive until a backward shows they were dropped,
    then the graph is planned again with them freed when the backward starts. A budget
    reachable only with them dropped is planned that way at once and checked at the
    first backward (a warning and a re-plan if they were kept). True or False fixes the
    assumption (True while outputs are held can exceed the budget by
    their size)."""
    time_slack: float = 0.02
    """With no budget: the share of the fastest plan's estimated step time fxremat may add,
    by recomputing cheap values, to lower the peak. The plan that runs is the lowest peak
    of: the fastest plan, the least peak within this slack, PyTorch's own partition, and
    pointwise-only recompute up to that partition's time, when they gain at least 2% (and,
    except PyTorch's partition, 1 MiB; docs/CONCEPTS.md). 0: the fastest plan. Ignored
    under a budget, where the fastest plan that fits runs."""
    reserve: int = 0
    """Bytes of the budget to leave for memory the step allocates outside fxremat's graphs: a
    loss computed outside the compiled model, DDP's gradient buckets, buffers of your own.
    Under FSDP2 fxremat adds FSDP's own (its unsharded parameters and gradient buffers, which
    its hooks allocate outside the compiled graphs) by itself. Int bytes or a string with a unit.
    Left at 0, a graph whose outputs hold no scalar loss leaves ``steps.CALLER_RESERVE`` times
    their gradient free for a loss computed on them, and keeps what its first backward shows the
    caller needs."""
    repeats: int = 1
    """How many times the compiled graph runs in one step before the backward reaches it: a
    block compiled on its own and called once per layer, or layers separated by graph breaks
    (FSDP2 wrapping each layer). Each earlier call keeps its saved activations alive while
    the later ones run, so a plan is judged at its peak plus ``repeats - 1`` times its saved
    bytes. 1 (default): fxremat counts the calls in the first step and, under a budget, plans
    such a graph again with the count it saw."""
    chunk_loss: str | int = "auto"
    """Compute an LM head and its cross-entropy a chunk of tokens at a time, so the logits'
    vocabulary-sized copies (fp32 logits, log-softmax, their gradient) never exist whole
    (``passes/chunk_loss.py``). "auto" (default): under a budget, when no plan fits without
    it, or when it makes the plan that fits faster; never without a budget. "off": never
    (a ``BudgetError`` then names the logits when they are why the budget is out of reach).
    "on": always, in as many chunks as "auto" would cut (a graph "auto" chunked is planned
    again this way: the first plan's choice stands). An int >= 2: always, in that many chunks."""
    hand_over_grads: bool = True
    """Hand each parameter's gradient to ``.grad`` as soon as the backward makes it, as eager
    autograd does, instead of returning all of them at the backward's end (``fxremat/grads.py``):
    with ``.grad`` already allocated (gradient accumulation, ``zero_grad(set_to_none=False)``)
    each gradient is added in and freed at once. Where autograd must see the gradients
    (``torch.autograd.grad``, hooks on a parameter, ``retain_graph``, ``torch.distributed``) they
    are returned as before; so are the smallest gradients, at most 1% of the bytes (biases, norm
    weights), and with no budget all of them where handing them over would lower the step's peak
    by less than 2%, or where their cost (about 1 us each: the checks above at each call, net of
    the adds autograd then skips) does not fit in ``time_slack`` of the estimated step (under
    Inductor its compute and one launch per kernel of its programs, not one per op).
    False: always return them at the end."""
    grads_allocated: bool | None = None
    """Whether the parameters' ``.grad`` exist when the backward runs (gradient accumulation,
    ``zero_grad(set_to_none=False)``): the backward then adds each gradient in and frees it
    (``hand_over_grads``), and the step peaks lower than a step that makes new ``.grad``. None
    (default): each graph is planned for steps without ``.grad`` (the first step, loops that set
    them to None), an upper bound for both; under a budget, once a backward has added its
    gradients into existing ``.grad`` and that plan leaves part of the budget unused, the graph
    is planned again for such steps too, and each call runs the plan for what it finds. True:
    plan for steps with ``.grad`` only (a step without them can exceed the budget by the
    gradients' bytes; a warning says so). False: plan for steps without them only. No effect
    without ``hand_over_grads``."""
    verify: bool = False
    """On each graph's first call, also run PyTorch's own partition of the graph on copies of
    the inputs and raise ``fxremat.VerificationError`` naming the first gradient that differs
    (``FXREMAT_VERIFY=1`` turns it on too). Costs one more compile per graph and two extra
    steps with a copy of the inputs on the first call; nothing afterwards."""

    @classmethod
    def from_mapping(cls, mapping: dict | None = None) -> "Options":
        """Validate a user's options (``torch.compile(..., options=...)``).

        Every field of ``Options`` may be given; a missing one takes its value from
        the environment where it has a variable (``FXREMAT_BUDGET``,
        ``FXREMAT_DUMP_DIR``, ``FXREMAT_VERIFY``), else the field's default.

        Args:
            mapping: option names to values; unknown names are rejected.

        Returns:
            Validated options with the budget in bytes.

        Raises:
            ValueError / TypeError: naming the option, the bad value and the accepted forms.
        """
        mapping = dict(mapping or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"unknown fxremat option(s) {unknown}; valid options are {sorted(known)}")
        values = {}
        for f in fields(cls):
            if f.name in mapping:
                values[f.name] = _VALIDATE.get(f.name, _as(f.type))(f.name, mapping[f.name])
            elif f.name in _FROM_ENV:
                values[f.name] = _FROM_ENV[f.name]()
            else:
                values[f.name] = f.default
        return cls(**values)

    def key(self) -> str:
        """A stable string of every option that changes the plan (for cache keys)."""
        plan_fields = asdict(self)
        plan_fields.pop("dump_dir")
        plan_fields.pop("verify")
        return json.dumps(plan_fields, sort_keys=True)


def _choice(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(valid)}")


def _as(type_name):
    """A validator for a plain field: bools must be bools."""
    if type_name == "bool":

        def check_bool(name: str, value):
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r} must be True or False")
            return value

        return check_bool
    return lambda name, value: value


def _one_of(valid):
    def check(name: str, value):
        _choice(name, value, valid() if callable(valid) else valid)
        return value

    return check


def _seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    return float(value)


def _share(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name}={value!r} must be a share of the step time between 0 and 1 (0.02 = 2%)")
    return float(value)


def _reserve(name: str, value) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    parsed = parse_budget(value, name=name)
    if parsed is None:
        raise TypeError(f"{name}=None: pass 0 to reserve nothing, or bytes (an int or a string such as '64MiB')")
    return parsed


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number of calls, at least 1")
    return value


def _chunks(name: str, value) -> str | int:
    if value in ("auto", "off", "on"):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"{name}={value!r} is not valid; pass 'auto', 'off', 'on' or a number of chunks (an int >= 2)")
    return value


def _path(name: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}={value!r} must be a path (str or os.PathLike)")
    return os.fspath(value)


# How each option is checked (fields not listed: by their type, see _as).
_VALIDATE = {
    "budget": lambda name, value: parse_budget(value, name=name),
    "inner": _one_of(INNERS),
    "solver": _one_of(_solver_names),
    "hardware": _one_of(tuple(HARDWARE)),
    "on_infeasible": _one_of(ON_INFEASIBLE),
    "on_error": _one_of(ON_ERROR),
    "time_limit": _seconds,
    "time_slack": _share,
    "repeats": _count,
    "reserve": _reserve,
    "chunk_loss": _chunks,
    "dump_dir": _path,
    "release_outputs": lambda name, value: value if value is None else _as("bool")(name, value),
    "grads_allocated": lambda name, value: value if value is None else _as("bool")(name, value),
}
# Options the environment supplies when the mapping does not.
_FROM_ENV = {
    "budget": budget_from_env,
    "dump_dir": lambda: os.environ.get(ENV_DUMP_DIR) or None,
    "verify": lambda: os.environ.get(ENV_VERIFY, "0") not in ("", "0"),
}
