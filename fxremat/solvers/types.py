"""Plain data types shared by every solver: the problem and the decision.

Nothing here imports torch. A ``RematProblem`` is the joint forward+backward
graph reduced to integers, floats and tuples; a ``Decision`` is what any solver
or reference policy returns for it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

__all__ = ["FORWARD", "BACKWARD", "RematProblem", "Decision", "SolveOptions", "SolveTimeout", "DEFAULT_TIME_LIMIT"]

FORWARD = 0
BACKWARD = 1


@dataclass(frozen=True)
class RematProblem:
    """The joint graph as plain data. Node ids are positions in topological order.

    Graph inputs (parameters, user inputs, RNG seeds) are not nodes: reading
    them is free and they are never counted, because they exist before the
    step whatever the plan.

    Attributes:
        names: node name per id (the fx node name), for reports.
        phase: ``FORWARD`` or ``BACKWARD`` per id.
        inputs: ids each node reads, in argument order (graph inputs omitted).
        nbytes: bytes of the storage the node allocates (0 for views, aliases
            and non-tensor values).
        storage: id of the node that owns the storage the node's output lives
            in (itself when it allocates).
        seconds: estimated time to compute the node once.
        flops: FLOPs to compute the node once.
        fw_outputs: forward ids returned to the user (alive to the step's end).
        bw_outputs: backward ids returned as gradients (alive to the step's end).
        tangents: backward ids that are gradient inputs, allocated when the
            backward starts.
        must_save: forward ids that must be kept if the backward needs them
            (user ``MUST_SAVE`` tags, outputs of effectful ops). A tagged view
            is saved through its storage: its owner is listed instead.
        never_recompute: forward ids that cannot run twice (random ops without
            RNG replay, mutations, effectful and collective ops).
        must_recompute: forward ids that may not be kept (user ``MUST_RECOMPUTE``).
        layer: index of the repeated block (e.g. transformer layer) a forward
            node belongs to, or -1; used by the per-layer and sqrt(n) policies.
        scratch: bytes a node allocates inside itself beyond its output while it
            runs (kernel workspace), or empty for none.
        fused: ids the compiler computes inside their consumers' kernels
            (Inductor's inlined pointwise values). A fused value allocates
            nothing and its inputs stay alive until its consumers run, unless
            it is kept or returned: then it is materialized.
        inplace: (writer, buffer) pairs: ``writer`` may write its output into
            ``buffer``'s storage when that storage is last used by ``writer``
            (Inductor's in-place buffer reuse); it then allocates nothing.
        outputs_released: the caller drops the forward's outputs before the
            backward runs (``loss = model(x).loss`` drops the logits), so they
            live to the forward's end, not to the step's end.
        copies: earlier calls of the same graph in the step, each holding its
            kept set while this call runs (a graph reused for every layer):
            every plan's peak counts its kept bytes ``copies`` more times.
        handed: backward ids computed and handed off as soon as they are made
            (parameters' gradients added into an existing ``.grad``): they
            run like returned gradients, but live only to their last use,
            not to the step's end.
    """

    names: tuple[str, ...]
    phase: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    storage: tuple[int, ...]
    seconds: tuple[float, ...]
    flops: tuple[int, ...]
    fw_outputs: tuple[int, ...] = ()
    bw_outputs: tuple[int, ...] = ()
    tangents: tuple[int, ...] = ()
    must_save: tuple[int, ...] = ()
    never_recompute: tuple[int, ...] = ()
    must_recompute: tuple[int, ...] = ()
    layer: tuple[int, ...] = ()
    scratch: tuple[int, ...] = ()
    fused: tuple[int, ...] = ()
    outputs_released: bool = False
    inplace: tuple[tuple[int, int], ...] = ()
    copies: int = 0
    handed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        if self.copies < 0:
            raise ValueError(f"RematProblem.copies is {self.copies}: earlier calls holding memory, at least 0")
        if not set(self.phase) <= {FORWARD, BACKWARD}:
            odd = sorted(set(self.phase) - {FORWARD, BACKWARD})
            raise ValueError(f"RematProblem.phase holds {odd}: each entry is FORWARD or BACKWARD")
        for name in ("phase", "inputs", "nbytes", "storage", "seconds", "flops"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"RematProblem.{name} has {len(getattr(self, name))} entries, expected {n}")
        for name in ("layer", "scratch"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"RematProblem.{name} has {len(getattr(self, name))} entries, expected {n} or 0")
        for v, ins in enumerate(self.inputs):
            for u in ins:
                if not 0 <= u < v:
                    raise ValueError(f"node {v} ({self.names[v]}) reads {u}: inputs must precede their users")
        for v in self.handed:
            if not 0 <= v < n or self.phase[v] != BACKWARD:
                raise ValueError(f"handed id {v} must be a backward node")
        for v in self.fused:
            if not 0 <= v < n or self.storage[v] != v:
                raise ValueError(f"fused id {v} must be a node that owns its storage")
        for v, u in self.inplace:
            if not 0 <= u < v < n or self.storage[u] != u or self.storage[v] != v:
                raise ValueError(f"in-place pair ({v}, {u}) must be a writer after a buffer owner, both owning storage")
        for v, s in enumerate(self.storage):
            if not 0 <= s <= v:
                raise ValueError(f"node {v} ({self.names[v]}) lives in storage {s}: owners must precede aliases")

    def derived(self, **changes) -> RematProblem:
        """``dataclasses.replace(self, **changes)`` without the checks of ``__post_init__``.

        For transformations that keep a checked problem well-formed by construction
        (``twice.with_split``, run about a thousand times in one nested search on HF GPT-2's
        1,237-node programs, where the checks were 8% of its time; ``tests/test_twice.py``
        runs them on its results).
        """
        new = copy.copy(self)
        for name, value in changes.items():
            if name not in self.__dataclass_fields__:
                raise TypeError(f"RematProblem has no field {name!r}")
            object.__setattr__(new, name, value)
        return new

    @property
    def size(self) -> int:
        return len(self.names)

    def is_forward(self, v: int) -> bool:
        return self.phase[v] == FORWARD

    def forward_ids(self) -> frozenset[int]:
        """Ids of the forward nodes, for loops that test many ids (computed on each call: hoist it)."""
        return frozenset([v for v, p in enumerate(self.phase) if p == FORWARD])


# Default safety net of one solve, in seconds. The slowest default solve measured,
# ``ilp`` on the 32-layer synthetic transformer of tests/test_solvers.py (2441
# nodes) at half its memory range, takes 12 s of CPU (15 s on a loaded 2-core
# host); 10x that leaves room for loaded and slower machines, and still stops a
# runaway solve.
DEFAULT_TIME_LIMIT = 120.0


@dataclass(frozen=True)
class SolveOptions:
    """Knobs every solver accepts. Defaults suit graphs of a few thousand nodes.

    A plan is a function of the problem, the budget and these options only:
    solvers stop on work limits (MILP nodes and rounds, simulations), never on
    the clock, so two machines, or one machine idle and under load, give the
    same plan. ``time_limit`` is only a safety net.
    """

    time_limit: float = DEFAULT_TIME_LIMIT
    """Safety net, in seconds, for one solve (nested solves included): past it the solver
    raises ``SolveTimeout`` rather than return a plan that depends on the machine's speed.
    ``math.inf`` disables it."""
    progress: object = None
    """Optional callable ``progress(done: int, total: int, message: str)``."""
    milp_nodes: int | None = None
    """Branch-and-bound nodes HiGHS may explore for one plan, over all its MILP solves; None:
    ``ilp.MILP_NODE_WORK`` (``registry.AUTO_MILP_NODE_WORK`` inside ``auto``) divided by the
    number of values to choose among, since a node costs more on a larger graph."""
    milp_rounds: int | None = None
    """MILP solves for one plan (one per plan the simulation rejects, plus the last); None:
    the solver's own limit (``ilp.MILP_ROUNDS``; ``registry.AUTO_MILP_ROUNDS`` inside ``auto``)."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.time_limit, bool)
            or not isinstance(self.time_limit, (int, float))
            or not self.time_limit > 0
        ):
            raise ValueError(
                f"SolveOptions.time_limit={self.time_limit!r} must be a positive number of seconds (math.inf: no limit)"
            )
        for name in ("milp_nodes", "milp_rounds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"SolveOptions.{name}={value!r} must be a positive int, or None for the solver's own limit"
                )


class SolveTimeout(RuntimeError):
    """A solve ran past its safety-net time limit (``SolveOptions.time_limit``).

    Solvers stop on work limits, so a plan never depends on the machine's
    load; the time limit only stops a runaway solve, and then no plan is
    returned, because whatever was found by then would depend on the load.

    Attributes:
        solver: the solver that was stopped.
        limit: the time limit, in seconds.
        doing: what it was doing when the limit passed.
    """

    def __init__(self, solver: str, limit: float, doing: str) -> None:
        self.solver, self.limit, self.doing = solver, limit, doing
        super().__init__(
            f"solver {solver!r} ran past its safety-net time limit of {limit:g} s ({doing}). "
            "A plan depends only on the graph, the budget and the options, never on time, so none is "
            "returned. Raise the time_limit option (SolveOptions.time_limit; math.inf disables the net), "
            "or choose a faster solver: 'mincut', or 'auto' rather than 'ilp' (SolveOptions.milp_nodes "
            "and milp_rounds bound the ILP's work)"
        )

    def __reduce__(self):
        # Pickle by the constructor's arguments, not the message (compile workers send errors back).
        return (SolveTimeout, (self.solver, self.limit, self.doing))


@dataclass(frozen=True)
class Decision:
    """What a solver chose: which forward values are kept and which recomputed.

    Attributes:
        kept: forward ids saved for the backward, sorted.
        recomputed: forward ids recomputed in the backward, sorted.
        peak_bytes: predicted peak of the step by liveness simulation.
        recompute_seconds: estimated time of the recomputed nodes.
        feasible: whether ``peak_bytes`` fits the budget it was solved for.
        solver: the name of the solver that chose it.
        solve_seconds: wall time spent solving.
        gap: relative optimality gap where the solver knows one, else None.
        note: one line on anything a user should know (a work limit hit, ...).
        twice: the most lifetime splits lowering may take: values recomputed a second time
            where their lifetimes span the backward's peak (``solvers/twice.py``); 0 for none.
            Only the least-memory plan asks for them (nested checkpoints).
    """

    kept: tuple[int, ...]
    recomputed: tuple[int, ...]
    peak_bytes: int
    recompute_seconds: float
    feasible: bool
    solver: str
    solve_seconds: float = 0.0
    gap: float | None = None
    note: str = field(default="")
    twice: int = 0
