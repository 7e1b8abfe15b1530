"""Min-cut rematerialization: a sweep of s-t cuts on the split-node graph (networkx).

Each relevant forward value ``v`` becomes two nodes, ``(v, IN)`` and
``(v, OUT)``. A cut puts every node on the source side (runs in the forward
only) or the sink side (available to the backward):

- ``SOURCE -> (v, IN)``, capacity ``seconds[v]``: cut when ``v`` is recomputed
  (infinite for values that may not run twice);
- ``(v, IN) -> (v, OUT)``, capacity ``lam * bytes``: cut when ``v`` is kept
  (0 for forward outputs, which the user holds anyway; infinite for
  ``must_recompute``);
- ``(u, OUT) -> (v, IN)``, infinite, for each forward input ``u`` of ``v``: a
  recomputed value needs its inputs in the backward;
- ``(v, OUT) -> SINK``, infinite, when a backward node reads ``v``.

Kept = values with ``(v, IN)`` on the source side and ``(v, OUT)`` on the sink
side. The cut minimises ``recompute seconds + lam * kept bytes``; it does not
see the transient memory of recomputation in the backward. So the sweep also
forces checkpoints (the inputs of every k-th layer, or of every k-th of
sqrt(n) segments) and cuts inside them, which bounds that transient, and
every distinct candidate is judged by the shared liveness simulation
(``schedule.decision``). Forced checkpoints split the graph into independent
pieces, which are cut separately.

When no candidate fits the budget, ``least_peak_search`` looks for a plan that
does: exhaustively when at most ``EXHAUSTIVE_MAX_CHOICES`` values are free to
choose (then the answer is exact), else by greedy single-value flips, at most
``greedy_max_evals`` simulations (a fixed amount of work: fewer on larger
graphs). Every step is bounded by counts, never by the clock, so the same
problem always gives the same plan.

Example:
    >>> d = solve_mincut(problem, budget=2 << 30, options=SolveOptions())
    >>> d.kept, d.peak_bytes, d.feasible
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import NamedTuple

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov

from . import schedule
from .policies import (
    has_layers,
    keep_all,
    keep_layer_inputs,
    keep_nothing,
    keep_segment_boundaries,
    layer_inputs,
    segment_boundaries,
    sqrt_segments,
)
from .memo import PerProblem
from .rules import Deadline, Rules, admit, best, rank, report_progress, rules
from .types import Decision, RematProblem, SolveOptions

__all__ = [
    "solve_mincut",
    "least_peak_search",
    "searched_greedily",
    "EXHAUSTIVE_MAX_CHOICES",
    "GREEDY_MAX_WORK",
    "greedy_max_evals",
]

logger = logging.getLogger(__name__)

# How ``solve_mincut``'s note starts when no cut fit and the greedy search ran (``searched_greedily`` reads it).
_NO_CUT_FITS = "no cut fits the budget"
_GREEDY = "greedy least-peak search"

# Trade-off range, in normalised units (fraction of all recompute seconds per
# fraction of all keepable bytes). 1e-3 is below any single value's share of
# either total in graphs of up to ~1000 values, so it keeps everything worth
# keeping; 1e3 makes any byte dearer than all recomputation.
LAM_MIN = 1e-3
LAM_MAX = 1e3
# Steps of the lam grid: 6 decades in 32 steps is a factor ~1.54 between
# neighbours, about the accuracy of the roofline cost model behind the seconds.
# Bisection visits log2(32) = 5 of them per variant.
LAM_GRID = 32
# When no lam fits, the coarse scan for the least peak looks at every
# LAM_GRID / 8 = 4th grid point (9 cuts), then halves the step around the best.
COARSE_STEPS = 8
# Largest piece (relevant forward values between forced checkpoints) a
# variant may cut besides stride 1. A variant costs ~7 cuts of ~3 distinct
# pieces plus ~11 simulations; networkx's Boykov-Kolmogorov takes ~10 ms on
# the ~400-node network of 200 values. On the synthetic GPT stacks of
# tests/test_solvers.py stride 1 won at every budget, and this bound keeps
# mincut under 1 s of CPU on their 3000-node version.
MAX_PIECE_VALUES = 200
# Exhaustive least-peak search up to 2**12 = 4096 plans: a few hundred ms on
# graphs small enough to have so few free choices.
EXHAUSTIVE_MAX_CHOICES = 12
# Greedy least-peak search: at most this much work, counted as simulations times
# the problem's nodes (a simulation replays every node: 3.5-5 ms a simulation
# on 900- to 1,400-node joint graphs here, so about 5 s of search), and never
# fewer than GREEDY_MIN_EVALS simulations. It is the only bound on the search (no
# clock). A flat 100 simulations stopped the search before one pass over the
# values: the benchmark CNN's least plan measured 40.0 MiB (per-layer
# checkpointing's 40.0) where the search run to its end finds 36.0 MiB, and
# benchmark Llama's 37.1 MiB where it finds 36.0.
GREEDY_MAX_WORK = 1_500_000
GREEDY_MIN_EVALS = 100


def greedy_max_evals(problem: RematProblem, share: float = 1.0) -> int:
    """How many simulations the greedy least-peak search may run on ``problem`` with ``share`` of its
    work (``GREEDY_MAX_WORK``, and of its floor ``GREEDY_MIN_EVALS``)."""
    return max(int(share * GREEDY_MIN_EVALS), int(share * GREEDY_MAX_WORK) // max(1, len(problem.names)))


# The two halves of a split forward value.
IN, OUT = 0, 1


class _Node(NamedTuple):
    """A network node: one half (``IN`` or ``OUT``) of a forward value, or a terminal.

    A plain tuple underneath, so hashing stays in C (an Enum member hashes in
    Python, which made networkx's dict lookups the bottleneck).
    """

    value: int
    port: int


# The terminals: value -1 is no node id.
_SOURCE = _Node(-1, IN)
_SINK = _Node(-1, OUT)


# --------------------------------------------------------------------------
# One cut
# --------------------------------------------------------------------------


def _costs(problem: RematProblem, rule: Rules) -> tuple[dict[int, float], dict[int, float]]:
    """Normalised (keep, recompute) cost per relevant value: each sums to 1 over the relevant values."""
    held = {problem.storage[v] for v in problem.fw_outputs}
    keep = {v: 0 if problem.storage[v] in held else problem.nbytes[problem.storage[v]] for v in rule.relevant}
    total_bytes = sum(keep.values()) or 1
    total_seconds = sum(problem.seconds[v] for v in rule.relevant) or 1.0
    return (
        {v: c / total_bytes for v, c in keep.items()},
        {v: problem.seconds[v] / total_seconds for v in rule.relevant},
    )


def _components(problem: RematProblem, nodes: list[int]) -> list[list[int]]:
    """Weakly connected pieces of the forward graph restricted to ``nodes``, each sorted, by first id."""
    parent = {v: v for v in nodes}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for v in nodes:
        for u in problem.inputs[v]:
            if u in parent:
                ru, rv = find(u), find(v)
                if ru != rv:
                    parent[max(ru, rv)] = min(ru, rv)
    pieces: dict[int, list[int]] = {}
    for v in nodes:
        pieces.setdefault(find(v), []).append(v)
    return [pieces[r] for r in sorted(pieces)]


class _Cutter:
    """Min cuts on one problem. Pieces that repeat (the same layer at another
    offset) are cut once per ``lam`` and shifted, so a stride of k layers costs
    about one k-layer cut, not L/k of them."""

    def __init__(self, problem: RematProblem, rule: Rules):
        self.problem, self.rule = problem, rule
        self.keep_cost, self.recompute_cost = _costs(problem, rule)
        self.needed = set(rule.needed)
        self.cache: dict[tuple, tuple[int, ...]] = {}
        self.pieces: dict[tuple[int, ...], tuple[tuple[int, ...], list[list[int]]]] = {}
        self.cuts = 0

    def split(self, forced=()) -> tuple[tuple[int, ...], list[list[int]]]:
        """(forced ids that count, pieces left to cut) for a forced set."""
        key = tuple(sorted(set(forced)))
        if key not in self.pieces:
            forced_set = (set(key) - self.rule.no_keep) & set(self.keep_cost)
            pieces = _components(self.problem, [v for v in self.rule.relevant if v not in forced_set])
            self.pieces[key] = (tuple(sorted(forced_set)), [p for p in pieces if any(v in self.needed for v in p)])
        return self.pieces[key]

    def cut(self, lam: float, forced=()) -> list[tuple[int, ...]]:
        """Kept ids per part: the forced ids first, then one entry per piece of ``split(forced)``."""
        forced_kept, pieces = self.split(forced)
        return [forced_kept] + [self._cut_piece(piece, lam) for piece in pieces]

    def kept(self, lam: float, forced=()) -> tuple[int, ...]:
        """Kept ids of the cut, forced ones included."""
        return _union(self.cut(lam, forced))

    def _signature(self, piece: list[int], members: set[int]) -> tuple:
        base, rule, problem = piece[0], self.rule, self.problem
        return tuple(
            (
                v - base,
                tuple(u - base for u in problem.inputs[v] if u in members),
                v in self.needed,
                v in rule.no_keep,
                v in rule.no_recompute,
                self.keep_cost[v],
                self.recompute_cost[v],
            )
            for v in piece
        )

    def _cut_piece(self, piece: list[int], lam: float) -> tuple[int, ...]:
        members = set(piece)
        key = (self._signature(piece, members), lam)
        if key not in self.cache:
            self.cache[key] = self._solve_piece(piece, members, lam)
        return tuple(piece[0] + offset for offset in self.cache[key])

    def _solve_piece(self, piece: list[int], members: set[int], lam: float) -> tuple[int, ...]:
        """Kept offsets (from ``piece[0]``) of the minimum cut of one piece."""
        rule, problem = self.rule, self.problem
        graph = nx.DiGraph()
        for v in piece:
            inp, out = _Node(v, IN), _Node(v, OUT)
            graph.add_edge(_SOURCE, inp, capacity=math.inf if v in rule.no_recompute else self.recompute_cost[v])
            graph.add_edge(inp, out, capacity=math.inf if v in rule.no_keep else lam * self.keep_cost[v])
            for u in problem.inputs[v]:
                if u in members:
                    graph.add_edge(_Node(u, OUT), inp, capacity=math.inf)
            if v in self.needed:
                graph.add_edge(out, _SINK, capacity=math.inf)
        self.cuts += 1
        _, (source_side, _) = nx.minimum_cut(graph, _SOURCE, _SINK, flow_func=boykov_kolmogorov)
        return tuple(v - piece[0] for v in piece if _Node(v, IN) in source_side and _Node(v, OUT) not in source_side)


# The budget search solves one problem at several targets: its cuts depend on the problem
# and lam alone, so each problem's cutter (and its cache of cut pieces) is kept across solves.
# On an 8-layer Llama-3-8B-shaped graph 10 solves made 416 cuts where 186 were distinct.
_CUTTERS: PerProblem[_Cutter] = PerProblem(lambda problem: _Cutter(problem, rules(problem)))


def _union(parts) -> tuple[int, ...]:
    return tuple(sorted(set().union(*parts)))


# --------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------


class _Candidates:
    """Simulates each distinct admitted kept set once and remembers the decisions.

    Each new simulation first checks the solve's safety-net ``deadline``.
    """

    def __init__(self, problem: RematProblem, rule: Rules, budget: int | None, solver: str, deadline: Deadline):
        self.problem, self.rule, self.budget, self.solver, self.deadline = problem, rule, budget, solver, deadline
        self.seen: dict[tuple[int, ...], Decision] = {}

    def judge(self, kept, label: str) -> Decision:
        key = admit(self.rule, kept)
        if key not in self.seen:
            self.deadline.check(f"simulating candidate {len(self.seen) + 1} of the min-cut search ({label})")
            d = schedule.decision(self.problem, key, self.budget, self.solver, note=label)
            self.seen[key] = d
            logger.debug(
                "%s: %s peak=%d recompute=%.3gs kept=%d",
                self.solver,
                label,
                d.peak_bytes,
                d.recompute_seconds,
                len(d.kept),
            )
        return self.seen[key]

    def best(self) -> Decision:
        return best(self.seen.values())


def _variants(problem: RematProblem, rule: Rules) -> list[tuple[str, tuple[int, ...]]]:
    """(label, forced ids) per cut variant, shortest stride first.

    Strides of 1, 2, 4, ... layers (or sqrt(n) segments) between forced
    checkpoints, while a piece stays under ``MAX_PIECE_VALUES``; then nothing
    forced, under the same limit. Stride 1 always.
    """
    if has_layers(problem):
        boundaries, unit = layer_inputs(problem), "layers"
    else:
        boundaries, unit = [()] + segment_boundaries(problem, sqrt_segments(problem)), "segments"
    count = len(boundaries)
    per_unit = len(rule.relevant) / max(count, 1)
    variants = []
    k = 1
    while count > 1 and k < count and (k == 1 or k * per_unit <= MAX_PIECE_VALUES):
        forced = sorted(set().union(*(boundaries[j] for j in range(0, count, k))))
        variants.append((f"checkpoints every {k} {unit}", tuple(forced)))
        k *= 2
    if len(rule.relevant) <= MAX_PIECE_VALUES:
        variants.append(("no forced checkpoints", ()))
    return variants


def _lam(i: int) -> float:
    """The i-th of ``LAM_GRID + 1`` geometric steps from ``LAM_MIN`` to ``LAM_MAX``."""
    return LAM_MIN * (LAM_MAX / LAM_MIN) ** (i / LAM_GRID)


class _Sweep:
    """The cuts of one forced set over the lam grid, judged against the budget."""

    def __init__(self, cands: _Candidates, cutter: _Cutter, label: str, forced):
        self.cands, self.cutter, self.label, self.forced = cands, cutter, label, forced
        self.parts: dict[int, list[tuple[int, ...]]] = {}

    def judge(self, i: int) -> Decision:
        if i not in self.parts:
            self.parts[i] = self.cutter.cut(_lam(i), self.forced)
        return self.cands.judge(_union(self.parts[i]), f"{self.label}, lam={_lam(i):.3g}")

    def run(self) -> None:
        """The fastest cut; if it does not fit, the least lam that fits, then mixes of the two nearest cuts."""
        if self.judge(0).feasible or self.cands.budget is None:
            return
        if self.judge(LAM_GRID).feasible:
            self.first_fit(0, LAM_GRID)
            return
        # Neither end fits. The peak falls with lam while kept bytes dominate,
        # then rises as the recompute transient grows: look for its minimum.
        coarse = range(0, LAM_GRID + 1, LAM_GRID // COARSE_STEPS)
        peaks = {}
        for i in coarse:
            d = self.judge(i)
            if d.feasible:
                self.first_fit(i - LAM_GRID // COARSE_STEPS, i)
                return
            peaks[i] = d.peak_bytes
        at = min(peaks, key=lambda i: (peaks[i], i))
        step = LAM_GRID // COARSE_STEPS // 2
        while step:
            for i in (at - step, at + step):
                if 0 <= i <= LAM_GRID:
                    d = self.judge(i)
                    if d.feasible:
                        self.first_fit(i - step, i)
                        return
                    if d.peak_bytes < peaks[at]:
                        at = i
                        peaks[i] = d.peak_bytes
            step //= 2

    def first_fit(self, lo: int, hi: int) -> None:
        """Bisect between a grid index that does not fit (lo) and one that does (hi), then mix them."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.judge(mid).feasible:
                hi = mid
            else:
                lo = mid
        if hi - lo == 1:
            self.mix(self.parts[lo], self.parts[hi])

    def mix(self, fast: list[tuple[int, ...]], lean: list[tuple[int, ...]]) -> None:
        """Plans between two cuts: the first j differing pieces from the lean cut, the rest from the fast one.

        Pieces are independent given the forced checkpoints, so this reaches
        budgets between two points of the lam sweep (which only finds points
        on the convex hull of time against bytes).
        """
        differ = [p for p in range(len(fast)) if fast[p] != lean[p]]
        lo, hi = 0, len(differ)  # hi: all lean, fits; lo: all fast, does not fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            switched = set(differ[:mid])
            parts = [lean[p] if p in switched else fast[p] for p in range(len(fast))]
            if self.cands.judge(_union(parts), f"{self.label}, {mid} of {len(differ)} pieces lean").feasible:
                hi = mid
            else:
                lo = mid


# --------------------------------------------------------------------------
# Least-peak search
# --------------------------------------------------------------------------


def least_peak_search(
    problem: RematProblem,
    budget: int | None,
    starts,
    solver: str = "mincut",
    deadline: Deadline | None = None,
    share: float = 1.0,
) -> tuple[Decision, str]:
    """Search for a plan that fits (else the least peak), when the usual candidates did not fit.

    With at most ``EXHAUSTIVE_MAX_CHOICES`` values free to choose (relevant,
    neither ``must_recompute`` nor forced to be kept), every kept set is tried
    and the result is exact: the fastest plan that fits, else the least peak
    over all plans. Otherwise single values are flipped greedily, from the
    least-peak start, while the peak falls, for at most ``greedy_max_evals``
    simulations.

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None.
        starts: kept sets to start from (the least-peak one is the start).
        solver: name recorded in the decisions.
        deadline: the safety net of the enclosing solve; None: a new one from
            the default ``SolveOptions``.
        share: the share of its work (``GREEDY_MAX_WORK``, and of its floor
            ``GREEDY_MIN_EVALS``) the greedy search may use.

    Returns:
        (best decision found, how it was searched: "exhaustive least-peak
        search", "greedy least-peak search", or the latter "stopped at its
        limit of ... simulations" when the work limit ended it).

    Raises:
        SolveTimeout: the safety net passed.
    """
    rule = rules(problem)
    cands = _Candidates(problem, rule, budget, solver, deadline or Deadline.start(solver, SolveOptions()))
    for kept in list(starts) or [keep_all(problem)]:
        cands.judge(kept, "start")
    choices = [v for v in rule.relevant if v not in rule.no_keep and v not in rule.no_recompute]
    if len(choices) <= EXHAUSTIVE_MAX_CHOICES:
        for mask in range(1 << len(choices)):
            cands.judge([v for i, v in enumerate(choices) if mask >> i & 1], "exhaustive")
        return cands.best(), "exhaustive least-peak search"
    current = cands.best()
    evals, most = 0, greedy_max_evals(problem, share)
    improved, capped = True, False
    moves = sorted(choices, key=lambda v: (-problem.nbytes[problem.storage[v]], v))  # big values first
    while improved and not current.feasible and not capped:
        improved = False
        for v in moves:
            if evals >= most:
                capped = True
                break
            flipped = admit(rule, set(current.kept) ^ {v})
            evals += flipped not in cands.seen
            d = cands.judge(flipped, f"greedy flip of {v}")
            if rank(d) < rank(current):
                current, improved = d, True
                if current.feasible:
                    break
    work = "GREEDY_MAX_WORK" if share == 1 else f"{share:g} of GREEDY_MAX_WORK"
    limit = f" stopped at its limit of {most} simulations ({work})" if capped else ""
    return cands.best(), f"{_GREEDY}{limit}"


# --------------------------------------------------------------------------
# Solver
# --------------------------------------------------------------------------


def searched_greedily(decision: Decision) -> bool:
    """Whether ``solve_mincut`` found ``decision`` by the greedy least-peak search: no cut of its sweep
    fit the budget, and too many values were free to try every choice."""
    return decision.note.startswith(f"{_NO_CUT_FITS}; {_GREEDY}")


def solve_mincut(
    problem: RematProblem,
    budget: int | None,
    options: SolveOptions = SolveOptions(),
    *,
    deadline: Deadline | None = None,
    search_below: bool = True,
    greedy_share: float = 1.0,
) -> Decision:
    """Choose kept values by a sweep of min cuts, judged by the liveness simulation.

    Candidates: the reference policies (save all, layer inputs or sqrt(n)
    segments, inputs only); then per variant (forced checkpoints every 1, 2,
    4, ... layers, and nothing forced on graphs of at most
    ``MAX_PIECE_VALUES`` relevant values) the fastest cut, and when it does
    not fit, a bisection on ``lam`` for the least ``lam`` whose plan fits
    followed by mixes of the two cuts around it, piece by piece. Returns the
    fastest candidate that fits; if none fits, the result of
    ``least_peak_search``. Every step is bounded by counts, never by the
    clock: the same input gives the same plan.

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None for the fastest plan.
        options: ``time_limit`` is a safety net (past it, ``SolveTimeout``);
            ``progress(done, total, message)`` is called after each variant.
        deadline: the safety net of an enclosing solve (``auto``, or the
            ILP's warm start), shared with it; None: a new one from
            ``options.time_limit``.
        search_below: when no cut fits, run ``least_peak_search`` (up to
            ``GREEDY_MAX_WORK`` of simulation); False: return the sweep's
            least-peak candidate, a bracket for ``solve_within``'s bisection.
        greedy_share: the share of its work that search may use
            (``greedy_max_evals``).

    Returns:
        The decision (``solver="mincut"``); ``feasible=False`` with the least
        peak found when nothing fits.

    Raises:
        ValueError: a ``must_recompute`` tag cannot be honoured.
        SolveTimeout: the search ran past ``options.time_limit``.
    """
    started = time.perf_counter()
    deadline = deadline or Deadline.start("mincut", options)
    rule = rules(problem)
    cands = _Candidates(problem, rule, budget, "mincut", deadline)
    cutter = _CUTTERS.get(problem)
    cuts_before = cutter.cuts
    policies = [("save_all", keep_all(problem)), ("inputs only", keep_nothing(problem))]
    policies.append(
        ("layer inputs", keep_layer_inputs(problem))
        if has_layers(problem)
        else ("sqrt(n) segments", keep_segment_boundaries(problem))
    )
    for label, kept in policies:
        cands.judge(kept, label)
    variants = _variants(problem, rule)
    for done, (label, forced) in enumerate(variants):
        _Sweep(cands, cutter, label, forced).run()
        report_progress(options, done + 1, len(variants), label)
    result = cands.best()
    note = result.note
    if not result.feasible and search_below:
        starts = sorted(cands.seen, key=lambda k: rank(cands.seen[k]))[:1]
        result, how = least_peak_search(problem, budget, starts, deadline=deadline, share=greedy_share)
        note = f"{_NO_CUT_FITS}; {how}: {result.note}"
    elif not result.feasible:
        note = f"{_NO_CUT_FITS}; the sweep's least peak: {result.note}"
    logger.info(
        "mincut: %d new cuts, %d candidates, peak %d, recompute %.3gs, feasible %s",
        cutter.cuts - cuts_before,
        len(cands.seen),
        result.peak_bytes,
        result.recompute_seconds,
        result.feasible,
    )
    return replace(result, solver="mincut", solve_seconds=time.perf_counter() - started, note=note)
