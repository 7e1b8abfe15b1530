"""All user options in one frozen, documented dataclass, validated at the edge."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Literal

from .budget import budget_from_env, parse_budget
from .passes.cost import HARDWARE

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
    """Peak bytes of the step's activations, temporaries and gradients; None: fastest plan."""
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
    time_limit: float = 10.0
    """Seconds the solver may spend per graph before returning its best feasible plan."""
    dump_dir: str | None = None
    """Folder where each compiled graph's plan is saved (one subfolder per graph)."""
    measure_scratch: bool = True
    """Measure each distinct op's kernel workspace once on the graph's device (CPU or
    CUDA), so predictions include it; off, or on meta/fake graphs, workspace counts 0."""
    calibrate: bool = False
    """Time each distinct op of the joint graph once on the graph's device (a few reps,
    median) and use those times instead of the ``hardware`` roofline; ops that cannot
    run standalone (random, in-place, effectful) keep the roofline estimate."""
    release_outputs: bool = False
    """The caller drops the forward's outputs before the backward (``loss = model(x).loss``
    drops the logits; so does ``transformers.Trainer``): plan them as freed when the
    backward starts. Off (default), outputs count as alive to the step's end; turn it on
    only when nothing holds them through backward, or the step can exceed the budget by
    their size."""
    verify: bool = False
    """On each graph's first call, also run PyTorch's own partition of the graph on copies of
    the inputs and raise ``fxremat.VerificationError`` naming the first gradient that differs
    (``FXREMAT_VERIFY=1`` turns it on too). Costs one more compile per graph and two extra
    steps with a copy of the inputs on the first call; nothing afterwards."""

    @classmethod
    def from_mapping(cls, mapping: dict | None = None) -> "Options":
        """Validate a user's options (``torch.compile(..., options=...)``).

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
        if "budget" in mapping:
            budget = parse_budget(mapping["budget"], name="budget")
        else:
            budget = budget_from_env()
        inner = mapping.get("inner", "inductor")
        _choice("inner", inner, INNERS)
        solver = mapping.get("solver", "auto")
        _choice("solver", solver, _solver_names())
        hardware = mapping.get("hardware", "cpu")
        _choice("hardware", hardware, tuple(HARDWARE))
        on_infeasible = mapping.get("on_infeasible", "error")
        _choice("on_infeasible", on_infeasible, ON_INFEASIBLE)
        on_error = mapping.get("on_error", "raise")
        _choice("on_error", on_error, ON_ERROR)
        time_limit = mapping.get("time_limit", 10.0)
        if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
            raise ValueError(f"time_limit={time_limit!r} must be a positive number of seconds")
        dump_dir = mapping.get("dump_dir", os.environ.get(ENV_DUMP_DIR) or None)
        if dump_dir is not None and not isinstance(dump_dir, (str, os.PathLike)):
            raise TypeError(f"dump_dir={dump_dir!r} must be a path (str or os.PathLike)")
        measure_scratch = mapping.get("measure_scratch", True)
        if not isinstance(measure_scratch, bool):
            raise TypeError(f"measure_scratch={measure_scratch!r} must be True or False")
        calibrate = mapping.get("calibrate", False)
        if not isinstance(calibrate, bool):
            raise TypeError(f"calibrate={calibrate!r} must be True or False")
        release_outputs = mapping.get("release_outputs", False)
        if not isinstance(release_outputs, bool):
            raise TypeError(f"release_outputs={release_outputs!r} must be True or False")
        verify = mapping.get("verify", os.environ.get(ENV_VERIFY, "0") not in ("", "0"))
        if not isinstance(verify, bool):
            raise TypeError(f"verify={verify!r} must be True or False")
        return cls(
            verify=verify, measure_scratch=measure_scratch, calibrate=calibrate, release_outputs=release_outputs,
            budget=budget, inner=inner, solver=solver, hardware=hardware, on_infeasible=on_infeasible,
            on_error=on_error, time_limit=float(time_limit), dump_dir=None if dump_dir is None else os.fspath(dump_dir),
        )

    def key(self) -> str:
        """A stable string of every option that changes the plan (for cache keys)."""
        plan_fields = asdict(self)
        plan_fields.pop("dump_dir")
        plan_fields.pop("verify")
        return json.dumps(plan_fields, sort_keys=True)


def _choice(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(valid)}")

