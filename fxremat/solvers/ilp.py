"""Exact rematerialization by integer programming (``scipy.optimize.milp``, HiGHS).

Binaries ``s_v`` (kept) and ``r_v`` (recomputed) for every relevant forward
value (one the backward reads, or an ancestor of one):

- ``s_v + r_v >= 1`` when the backward reads ``v``;
- ``r_v <= s_u + r_u`` for each forward input ``u`` of ``v``;
- ``s_v + r_v <= 1``, and ``s_v + r_v <= sum of r_w`` over the forward
  readers ``w`` of ``v`` when the backward does not read ``v``: values are
  kept or recomputed only when needed, so a solution is exactly a closed plan
  (``schedule.close`` of its kept set) and a no-good cut on ``s`` removes
  exactly one plan;
- at most one kept value per storage (``schedule.one_per_storage``);
- ``r_v = 0`` for ``never_recompute``/``must_save`` values (and forward
  outputs, which the user holds anyway); ``s_v = 0`` for ``must_recompute``.

The objective is the recompute time, plus a tie-break on kept bytes
(``TIE_BREAK``). The true constraint is the simulated peak. The program holds
rows that every plan that fits satisfies (a relaxation):

- memory at the end of the forward: forward outputs plus every kept storage;
- memory at each backward node: the backward's own buffers (the same for
  every plan, since recomputation is only inserted between backward nodes),
  kept values read there or later, recomputed values read both there or
  earlier and there or later;
- added lazily at the backward node where a rejected plan peaked: the same
  with views sharing storage and with recomputed chains (a value recomputed
  because a recomputed reader was needed earlier is alive too), through
  auxiliary continuous variables.

The solver starts from min-cut's plan, and only looks for plans at least as
fast when that one fits. It iterates: solve, simulate with
``schedule.decision``; when the plan does not fit, add the lazy row for its
peak and a no-good cut excluding exactly that plan, and solve again. The
first plan that fits is then the fastest plan that fits. After ``EXACT_ROUNDS`` rejected plans the end-of-
forward row is lowered by each plan's overshoot instead (a heuristic: it may
cut off the optimum, and the gap is then unknown).

The search stops on work limits only: branch-and-bound nodes over all HiGHS
solves (``MILP_NODE_WORK`` divided by the number of relevant values) and
``MILP_ROUNDS`` solves (``SolveOptions.milp_nodes`` and ``milp_rounds``
override them), so the same problem gives the same plan on any machine under
any load. ``SolveOptions.time_limit`` is only a safety net
that raises ``SolveTimeout``.

Example:
    >>> d = solve_ilp(problem, budget=2 << 30, options=SolveOptions())
    >>> d.gap  # 0.0: proven optimal
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

from ..quiet import quiet_stdout
from . import schedule
from .layers import repeated_values
from .mincut import solve_mincut
from .rules import Deadline, Rules, best, forward_ancestors, report_progress, rules
from .types import Decision, RematProblem, SolveOptions, SolveTimeout

__all__ = ["solve_ilp", "EXACT_ROUNDS", "MILP_NODE_WORK", "MILP_ROUNDS"]

logger = logging.getLogger(__name__)

# Rejected plans before switching to lowering the end-of-forward row: each
# round is one HiGHS solve (~10-100 ms at a few hundred values), so 50 rounds
# stay within a few seconds.
EXACT_ROUNDS = 50
# HiGHS's relative MIP gap at which a solve counts as optimal. Its default,
# 1e-4, would let the solver stop at a plan 0.01% slower than the best; 1e-6 is
# below any difference the cost model can tell.
MIP_REL_GAP = 1e-6
# Weight of kept bytes in the objective: all kept bytes together weigh at most
# this fraction of the cheapest single recomputation, so bytes only break ties
# between plans of equal time.
TIE_BREAK = 1e-3
# Work HiGHS may spend on one plan, in branch-and-bound nodes times relevant
# values (the LP's columns): the plan gets ``MILP_NODE_WORK // relevant`` nodes
# over all its MILP solves, a solve counting at least one. A node's LP grows with
# the graph, so a fixed node count would starve small graphs or run for minutes
# on large ones. Measured on the synthetic transformers of tests/test_solvers.py
# (2-32 layers, 74-1124 relevant values) at budgets where HiGHS cannot prove
# optimality: a node cost 2-16 ms of CPU up to ~300 values, ~35 ms at 424 and
# ~230 ms at 1124. 50k nodes x values (676 nodes at 74 values, 118 at 424, 44
# at 1124) keeps the slowest of them, the 32-layer one, at 12 s of CPU, about
# the 10 s the ILP had by the clock before; 100k gave the same plans in 1.1-1.9x
# the time.
MILP_NODE_WORK = 50_000
# MILP solves for one plan, exact and heuristic rounds together: as many
# heuristic rounds as exact ones. Large graphs stop on nodes first (2-3 rounds
# on the 12- and 32-layer transformers); small ones need up to ~EXACT_ROUNDS.
MILP_ROUNDS = 2 * EXACT_ROUNDS
# HiGHS statuses, as scipy.optimize.milp reports them: 1 is its time (or
# iteration) limit; a node limit comes back as 4, "Solution limit reached".
_OPTIMAL, _TIME_LIMIT, _INFEASIBLE = 0, 1, 2


def _milp():
    """Import scipy's MILP interface lazily, with an install hint when it is missing."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 'ilp' solver needs scipy>=1.9 (scipy.optimize.milp with HiGHS): "
            "pip install scipy, or choose solver='mincut'"
        ) from e
    return np, Bounds, LinearConstraint, milp, coo_array


# --------------------------------------------------------------------------
# Facts about the problem that do not depend on the plan
# --------------------------------------------------------------------------


@dataclass
class _Facts:
    """Costs, storages and the backward's own memory, computed once.

    Attributes:
        column: relevant forward value -> its index among ``rule.relevant``.
        storage_of: relevant value -> index of its counted storage (absent
            when its bytes never count: forward outputs, which are held
            anyway, and zero-byte storages).
        storage_bytes: bytes per counted storage.
        output_bytes: bytes of the forward outputs, alive from the forward's
            end to the step's end whatever the plan.
        backward: the backward nodes in the order they run (every plan).
        fixed: per backward position, bytes the backward holds there
            regardless of the plan (its buffers, its scratch, the outputs).
        reads: relevant value -> backward positions that read it, sorted.
        readers: relevant value -> its relevant forward readers.
    """

    problem: RematProblem
    rule: Rules
    column: dict[int, int]
    storage_of: dict[int, int]
    storage_bytes: list[int]
    output_bytes: int
    backward: tuple[int, ...]
    fixed: list[int]
    reads: dict[int, list[int]]
    readers: dict[int, list[int]]

    def kept_bytes(self, kept) -> int:
        """Bytes of the distinct counted storages a kept set holds."""
        return sum(self.storage_bytes[c] for c in {self.storage_of[v] for v in kept if v in self.storage_of})

    def position_after(self, program: tuple[int, ...], step: int) -> int:
        """Backward position of the first backward node at or after ``step`` of ``program``."""
        index = {v: i for i, v in enumerate(self.backward)}
        for v in program[step:]:
            if v in index:
                return index[v]
        return len(self.backward) - 1


def _facts(problem: RematProblem, rule: Rules) -> _Facts:
    column = {v: i for i, v in enumerate(rule.relevant)}
    held = {problem.storage[o] for o in problem.fw_outputs}
    storage_col: dict[int, int] = {}
    storage_of: dict[int, int] = {}
    storage_bytes: list[int] = []
    for v in rule.relevant:
        owner = problem.storage[v]
        # A view's bytes count only when its owner runs before it (always, in
        # graphs from fx); otherwise counting them could break the relaxation.
        if owner in held or not problem.nbytes[owner] or (owner != v and owner not in forward_ancestors(problem, [v])):
            continue
        if owner not in storage_col:
            storage_col[owner] = len(storage_bytes)
            storage_bytes.append(problem.nbytes[owner])
        storage_of[v] = storage_col[owner]
    allocated_outputs = {
        problem.storage[o]
        for o in problem.fw_outputs
        if problem.storage[o] == o or problem.storage[o] in forward_ancestors(problem, [o])
    }
    output_bytes = sum(problem.nbytes[s] for s in allocated_outputs)

    # The backward of the plan that keeps everything: every plan runs the same
    # backward nodes in the same order, with recomputation in between.
    _, program = schedule.programs(problem, rule.needed, ())
    backward = tuple(v for v in program if not problem.is_forward(v))
    position = {v: i for i, v in enumerate(backward)}
    storage = problem.storage
    pinned = {storage[v] for v in problem.bw_outputs}
    # Fused backward values never exist unless returned, whatever the plan: their
    # readers read what they read (exact); counting them would break the relaxation.
    fused = {v for v in problem.fused if not problem.is_forward(v)} - pinned
    inputs = schedule.reads(problem, frozenset(fused))
    last: dict[int, int] = {}
    for i, v in enumerate(backward):
        for u in (v,) + inputs[v]:
            if u in position:
                last[storage[u]] = max(last.get(storage[u], -1), i)
    fixed = [0] * (len(backward) + 1)
    # A value that may write into a dying buffer (in-place) may allocate nothing: not counted.
    writers = {w for w, _ in problem.inplace}
    for i, v in enumerate(backward):
        if storage[v] == v and problem.nbytes[v] and v not in fused and v not in writers:
            fixed[i] += problem.nbytes[v]
            fixed[len(backward) if v in pinned else last[v] + 1] -= problem.nbytes[v]
    for i in range(1, len(backward) + 1):
        fixed[i] += fixed[i - 1]
    for i, v in enumerate(backward):
        fixed[i] += (0 if problem.outputs_released else output_bytes) + (problem.scratch[v] if problem.scratch else 0)
    reads: dict[int, list[int]] = {}
    for i, b in enumerate(backward):
        for u in inputs[b]:
            if u in column and (not reads.get(u) or reads[u][-1] != i):
                reads.setdefault(u, []).append(i)
    readers: dict[int, list[int]] = {v: [] for v in rule.relevant}
    for v in rule.relevant:
        for u in problem.inputs[v]:
            if problem.is_forward(u):
                readers[u].append(v)
    return _Facts(
        problem, rule, column, storage_of, storage_bytes, output_bytes, backward, fixed[: len(backward)], reads, readers
    )


# --------------------------------------------------------------------------
# The program
# --------------------------------------------------------------------------


@dataclass
class _Program:
    """The MILP as growing sparse rows over a growing set of variables."""

    facts: _Facts
    cost: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    entries: list[tuple[int, int, float]] = field(default_factory=list)
    lower_rhs: list[float] = field(default_factory=list)
    upper_rhs: list[float] = field(default_factory=list)
    step_rows: set[int] = field(default_factory=set)
    bytes_scale: float = 1.0
    memory_row: int = -1
    held: list[tuple[int, float]] = field(default_factory=list)
    """Terms of the kept bytes the graph's earlier calls hold at every step (``RematProblem.copies``)."""

    def var(self, cost: float, upper: float, integer: bool) -> int:
        self.cost.append(cost)
        self.upper.append(upper)
        self.integer.append(int(integer))
        return len(self.cost) - 1

    def row(self, terms, low: float, high: float) -> int:
        r = len(self.lower_rhs)
        self.entries.extend((r, c, x) for c, x in terms)
        self.lower_rhs.append(low)
        self.upper_rhs.append(high)
        return r

    def s(self, v: int) -> int:
        return self.facts.column[v]

    def r(self, v: int) -> int:
        return len(self.facts.rule.relevant) + self.facts.column[v]

    def exclude(self, kept: tuple[int, ...]) -> None:
        """No-good cut: the kept set may not be exactly ``kept``."""
        inside = {self.s(v) for v in kept if v in self.facts.column}
        terms = [(self.s(v), -1.0 if self.s(v) in inside else 1.0) for v in self.facts.rule.relevant]
        self.row(terms, 1.0 - len(inside), float("inf"))

    def add_step_row(self, p: int, budget: int) -> None:
        """The live bytes at backward position ``p``, exactly, must fit (see module docstring).

        ``e_v`` is 1 exactly when ``v`` is recomputed before the backward
        node at ``p`` runs: it is recomputed just before the first backward
        node that needs it, directly or through recomputed readers. A value's
        storage is alive at ``p`` when the value is kept or recomputed before
        ``p``, and something uses it at or after ``p``: a backward reader, or
        a recomputed reader not recomputed before ``p``. A storage counts
        once, however many of its values are alive.
        """
        if p in self.step_rows:
            return
        self.step_rows.add(p)
        facts, rule = self.facts, self.facts.rule
        inf = float("inf")
        early: dict[int, int] = {}
        for v in reversed(rule.relevant):
            if v in rule.no_recompute:
                continue
            direct = bool(facts.reads.get(v)) and facts.reads[v][0] <= p
            via = [early[w] for w in facts.readers[v] if w in early]
            if not direct and not via:
                continue
            e = early[v] = self.var(0.0, 1.0, False)
            self.row([(e, 1.0), (self.r(v), -1.0)], -inf, 0.0)
            if direct:
                self.row([(e, 1.0), (self.r(v), -1.0)], 0.0, inf)
            else:
                self.row([(e, 1.0)] + [(ew, -1.0) for ew in via], -inf, 0.0)
                for ew in via:
                    self.row([(e, 1.0), (self.r(v), -1.0), (ew, -1.0)], -1.0, inf)
        alive: dict[int, int] = {}
        fused = set(facts.problem.fused)
        for v in rule.relevant:
            if v not in facts.storage_of:
                continue
            col = facts.storage_of[v]
            # A recomputed fused value is computed inside its readers' kernels: only keeping it costs memory.
            recomputed_costs = v in early and facts.problem.storage[v] not in fused
            held = [(self.s(v), 1.0)] + ([(early[v], 1.0)] if recomputed_costs else [])
            used_late = bool(facts.reads.get(v)) and facts.reads[v][-1] >= p
            late_readers = [w for w in facts.readers[v] if w not in rule.no_recompute]
            if not used_late and not late_readers:
                continue
            if col not in alive:
                alive[col] = self.var(0.0, 1.0, False)
            a = alive[col]
            for h in held:
                if used_late:
                    self.row([(a, 1.0), (h[0], -1.0)], 0.0, inf)
                for w in late_readers:
                    # v is held, w is recomputed, and not before p: w reads v at or after p.
                    self.row(
                        [(a, 1.0), (h[0], -1.0), (self.r(w), -1.0)] + ([(early[w], 1.0)] if w in early else []),
                        -1.0,
                        inf,
                    )
        terms = [(a, facts.storage_bytes[col] / self.bytes_scale) for col, a in sorted(alive.items())]
        self.row(terms + self.held, -inf, (budget - facts.fixed[p]) / self.bytes_scale)

    def solve(self, memory_limit: float | None, nodes: int, seconds_left: float):
        """One HiGHS solve, stopped after ``nodes`` branch-and-bound nodes, or ``seconds_left`` (the safety net)."""
        np, Bounds, LinearConstraint, milp, coo_array = _milp()
        n = len(self.cost)
        high = list(self.upper_rhs)
        if self.memory_row >= 0:
            high[self.memory_row] = float("inf") if memory_limit is None else memory_limit / self.bytes_scale
        constraints = []
        if self.lower_rhs:
            rows, cols, vals = zip(*self.entries) if self.entries else ((), (), ())
            matrix = coo_array(
                (np.array(vals, dtype=float), (np.array(rows, dtype=int), np.array(cols, dtype=int))),
                shape=(len(self.lower_rhs), n),
            ).tocsr()
            constraints.append(LinearConstraint(matrix, np.array(self.lower_rhs), np.array(high)))
        options: dict[str, object] = {"node_limit": nodes, "mip_rel_gap": MIP_REL_GAP, "disp": False}
        if math.isfinite(seconds_left):
            options["time_limit"] = max(seconds_left, 1e-3)
        with quiet_stdout():  # HiGHS prints MIP progress from C++ whatever disp says
            return milp(
                np.array(self.cost),
                integrality=np.array(self.integer),
                bounds=Bounds(np.zeros(n), np.array(self.upper)),
                constraints=constraints,
                options=options,
            )

    def kept(self, x) -> tuple[int, ...]:
        return tuple(v for v in self.facts.rule.relevant if x[self.s(v)] > 0.5)


def _program(facts: _Facts, budget: int | None, cutoff_seconds: float | None) -> _Program:
    """Variables s, r, one per storage, and the rows every round shares."""
    problem, rule = facts.problem, facts.rule
    prog = _Program(facts)
    total_seconds = sum(problem.seconds[v] for v in rule.relevant) or 1.0
    cheapest = (
        min((problem.seconds[v] for v in rule.relevant if problem.seconds[v] > 0), default=total_seconds)
        / total_seconds
    )
    prog.bytes_scale = float(sum(facts.storage_bytes)) or 1.0
    for v in rule.relevant:
        prog.var(0.0, 0.0 if v in rule.no_keep else 1.0, True)
    for v in rule.relevant:
        prog.var(problem.seconds[v] / total_seconds, 0.0 if v in rule.no_recompute else 1.0, True)
    storage_var = [prog.var(TIE_BREAK * cheapest * b / prog.bytes_scale, 1.0, False) for b in facts.storage_bytes]
    if problem.copies:
        prog.held = [(c, problem.copies * b / prog.bytes_scale) for c, b in zip(storage_var, facts.storage_bytes)]
    needed = set(rule.needed)
    for v in rule.relevant:
        for u in problem.inputs[v]:
            if problem.is_forward(u):
                prog.row([(prog.r(v), 1.0), (prog.s(u), -1.0), (prog.r(u), -1.0)], -float("inf"), 0.0)
        if v in needed:
            prog.row([(prog.s(v), 1.0), (prog.r(v), 1.0)], 1.0, 1.0)
        else:
            prog.row(
                [(prog.s(v), 1.0), (prog.r(v), 1.0)] + [(prog.r(w), -1.0) for w in facts.readers[v]], -float("inf"), 0.0
            )
            prog.row([(prog.s(v), 1.0), (prog.r(v), 1.0)], 0.0, 1.0)
        if v in facts.storage_of:
            prog.row([(storage_var[facts.storage_of[v]], 1.0), (prog.s(v), -1.0)], 0.0, float("inf"))
    # At most one value per storage is kept (``schedule.one_per_storage``), unless several
    # aliases cannot be recomputed: then ``close`` keeps them all, and so may the program.
    for members in schedule.alias_groups(problem, rule.relevant).values():
        if len(members) > 1 and sum(v in rule.no_recompute for v in members) <= 1:
            prog.row([(prog.s(v), 1.0) for v in members], -float("inf"), 1.0)
    if budget is not None:
        prog.memory_row = prog.row(
            [(c, (1 + problem.copies) * b / prog.bytes_scale) for c, b in zip(storage_var, facts.storage_bytes)],
            -float("inf"),
            float("inf"),
        )
        # Cheap rows at every backward node that reads a forward value: owners only
        # (a recomputed fused value lives inside its readers' kernels: only keeping it costs).
        fused = set(problem.fused)
        for p in sorted({i for at in facts.reads.values() for i in at}):
            terms = []
            for v, at in facts.reads.items():
                if v in facts.storage_of and problem.storage[v] == v and at[-1] >= p:
                    b = facts.storage_bytes[facts.storage_of[v]] / prog.bytes_scale
                    terms.append((prog.s(v), b))
                    if at[0] <= p and v not in fused:
                        terms.append((prog.r(v), b))
            prog.row(terms + prog.held, -float("inf"), (budget - facts.fixed[p]) / prog.bytes_scale)
    if cutoff_seconds is not None:
        # Only plans at least as fast as the warm start are of interest.
        slack = 1e-9 * max(1.0, cutoff_seconds / total_seconds)
        prog.row(
            [(prog.r(v), problem.seconds[v] / total_seconds) for v in rule.relevant],
            -float("inf"),
            cutoff_seconds / total_seconds + slack,
        )
    return prog


# --------------------------------------------------------------------------
# Solver
# --------------------------------------------------------------------------


def solve_ilp(
    problem: RematProblem,
    budget: int | None,
    options: SolveOptions = SolveOptions(),
    *,
    warm: Decision | None = None,
    deadline: Deadline | None = None,
    node_work: int = MILP_NODE_WORK,
    max_rounds: int = MILP_ROUNDS,
    tie_layers: bool = False,
) -> Decision:
    """The fastest plan whose simulated peak fits the budget, by MILP with lazy rows and no-good cuts.

    Starts from min-cut's plan (the warm start): when it fits, only plans at
    least as fast are searched, and it is returned, proven optimal, when no
    faster plan fits. When nothing fits, min-cut's least-peak search gives
    the least peak; when a work limit cuts the MILP short, the best plan
    seen (warm start included) comes back, and ``Decision.note`` says which
    limit was hit.

    ``Decision.gap`` is 0.0 when the plan is proven the fastest that fits:
    every HiGHS solve finished within ``MIP_REL_GAP`` and the program only
    held rows that every fitting plan satisfies, so the first plan that fit
    is optimal (or nothing faster than the warm start fits). When HiGHS
    stopped at the node limit it is HiGHS's ``mip_gap`` for that solve, which
    bounds the true gap for the same reason. It is None when no bound is
    known: the plan is the warm start's and the search was cut short, or it
    came after heuristic tightening. The objective's tie-break on bytes is
    part of the gap.

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None for the fastest plan.
        options: ``milp_nodes`` and ``milp_rounds`` (work limits that
            override ``node_work`` and ``max_rounds``), ``time_limit`` (a
            safety net over min-cut and all MILP rounds together) and
            ``progress(done, total, message)``, called once per round.
        warm: ``solve_mincut``'s decision for the same problem and budget,
            when the caller already has it; otherwise min-cut runs first.
        deadline: the safety net of an enclosing solve (``auto``), shared
            with it; None: a new one from ``options.time_limit``.
        node_work: branch-and-bound nodes times relevant values for the
            plan (see ``MILP_NODE_WORK``).
        max_rounds: MILP solves for the plan.
        tie_layers: give every value the same decision in each identical layer
            (``layers.repeated_values``): one layer is solved and its choice applied to
            every copy, the values between layers still chosen one by one. The
            program's binaries shrink by the number of layers; ``gap`` is then among
            such plans only.

    Returns:
        The decision (``solver="ilp"``); ``feasible=False`` with the least
        peak found when nothing fits.

    Raises:
        ValueError: a ``must_recompute`` tag cannot be honoured.
        ImportError: scipy is not installed.
        SolveTimeout: the solve ran past ``options.time_limit``.
    """
    started = time.perf_counter()
    deadline = deadline or Deadline.start("ilp", options)
    rule = rules(problem)
    if not rule.relevant:
        # The backward reads no forward value: there is nothing to choose.
        d = schedule.decision(problem, (), budget, "ilp", gap=0.0)
        return replace(d, solve_seconds=time.perf_counter() - started)
    nodes = options.milp_nodes or max(1, node_work // len(rule.relevant))
    max_rounds = options.milp_rounds or max_rounds
    if warm is None:
        warm = solve_mincut(problem, budget, replace(options, progress=None), deadline=deadline)
    facts = _facts(problem, rule)
    cutoff = warm.recompute_seconds if warm.feasible and budget is not None else None
    program = _program(facts, budget, cutoff)
    classes = repeated_values(problem, rule) if tie_layers else ()
    for same in classes:
        for v in same[1:]:
            program.row([(program.s(same[0]), 1.0), (program.s(v), -1.0)], 0.0, 0.0)
            program.row([(program.r(same[0]), 1.0), (program.r(v), -1.0)], 0.0, 0.0)
    memory_limit = None if budget is None else budget - facts.output_bytes
    tried: dict[tuple[int, ...], Decision] = {}
    found: Decision | None = None
    # When the forward outputs alone exceed the budget, no plan fits (proven).
    exact, exhausted = True, memory_limit is not None and memory_limit < 0
    gap: float | None = None
    rounds = used = 0  # MILP solves, and branch-and-bound nodes they explored
    limited = ""  # the work limit that stopped the search, if one did
    while not exhausted:
        if rounds >= max_rounds:
            limited = f"MILP round limit {max_rounds} hit"
            break
        if used >= nodes:
            limited = limited or f"MILP node limit {nodes} hit in round {rounds}"
            break
        deadline.check(f"before MILP round {rounds + 1}")
        res = program.solve(memory_limit, nodes - used, deadline.left())
        if res.status == _TIME_LIMIT:
            raise SolveTimeout(deadline.solver, deadline.limit, f"HiGHS stopped in MILP round {rounds + 1}")
        if res.status == _INFEASIBLE:
            exhausted = True
            break
        rounds += 1
        explored = max(1, int(res.mip_node_count or 0))  # a solve that presolve settles counts one
        if res.status != _OPTIMAL:
            if explored >= nodes - used:
                # HiGHS stopped at the node limit (scipy: status 4, "Solution limit reached").
                limited = f"MILP node limit {nodes} hit in round {rounds}"
            else:
                limited = f"HiGHS stopped in MILP round {rounds}: {res.message}"
            explored = nodes - used  # either way, no further round
        used += explored
        if res.x is None:
            break
        d = schedule.decision(problem, program.kept(res.x), budget, "ilp")
        repeated = d.kept in tried
        tried[d.kept] = d
        report_progress(options, rounds, max_rounds, f"ILP round {rounds}: peak {d.peak_bytes}, fits {d.feasible}")
        logger.debug(
            "ilp round %d: status %d, nodes %s, peak %d, recompute %.3gs, feasible %s",
            rounds,
            res.status,
            res.mip_node_count,
            d.peak_bytes,
            d.recompute_seconds,
            d.feasible,
        )
        if d.feasible:
            found = d
            if exact:
                gap = 0.0 if res.status == _OPTIMAL else (None if res.mip_gap is None else float(res.mip_gap))
            break
        # A plan with no budget always fits, so the loop only gets here with one.
        assert budget is not None and memory_limit is not None
        if repeated:
            # The same plan came back: its cut did not hold (numerical trouble).
            exact = False
        program.exclude(d.kept)
        forward, backward = schedule.programs(problem, d.kept, d.recomputed)
        timeline = schedule.liveness(problem, forward, backward, d.kept)
        if timeline.peak_step >= len(forward):
            program.add_step_row(facts.position_after(backward, timeline.peak_step - len(forward)), budget)
        if rounds >= EXACT_ROUNDS:
            # Heuristic: ask for less kept memory by this plan's overshoot.
            exact = False
            memory_limit = min(memory_limit, facts.kept_bytes(d.kept) - (d.peak_bytes - budget))
            if memory_limit < 0:
                break
    notes = []
    if found is not None:
        # With a warm start that fits, the MILP only looked for plans at least as fast.
        result = best([found, warm]) if warm.feasible else found
    elif exhausted and exact and warm.feasible:
        # Nothing at least as fast as the warm start fits, but the warm start.
        result, gap = warm, 0.0
        notes.append(
            "no plan tied across layers is faster than the min-cut plan"
            if classes
            else "the MILP proved the min-cut plan optimal"
        )
    else:
        result = best(list(tried.values()) + [warm])
        if exhausted and exact:
            notes.append("no plan fits the budget (proven)")
    if result is warm:
        notes.insert(0, f"min-cut plan ({warm.note})" if warm.note else "min-cut plan")
    if classes:
        notes.append(f"{len(classes[0])} identical layers solved as one ({len(classes)} values tied)")
    if limited:
        notes.append(limited)
    if not exact:
        notes.append(f"heuristic after {EXACT_ROUNDS} rejected plans: the end-of-forward row was lowered")
    if budget is not None and budget < facts.output_bytes:
        notes.append("the forward outputs alone exceed the budget")
    logger.info(
        "ilp: %d rounds, peak %d, recompute %.3gs, feasible %s, gap %s",
        rounds,
        result.peak_bytes,
        result.recompute_seconds,
        result.feasible,
        gap,
    )
    return replace(result, solver="ilp", gap=gap, solve_seconds=time.perf_counter() - started, note="; ".join(notes))
