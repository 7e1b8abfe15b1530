"""From a kept set to programs and a predicted peak, on the plain problem.

``close`` derives what must be recomputed from what is kept (one function for
every solver). ``programs`` orders the forward and backward the way
``passes/apply.py`` orders the real graphs: the forward in topological order,
the backward in topological order with each recomputed value inserted just
before its first use. ``liveness`` replays a program, allocating each storage
when its owner runs and freeing it after the last use of any alias.
"""

from __future__ import annotations

from dataclasses import dataclass

from .memo import PerProblem
from .types import BACKWARD, FORWARD, Decision, RematProblem

__all__ = [
    "bw_reads",
    "close",
    "one_per_storage",
    "alias_groups",
    "ancestors",
    "programs",
    "virtual",
    "reads",
    "liveness",
    "Timeline",
    "evaluate",
    "decision",
]


def bw_reads(problem: RematProblem) -> tuple[int, ...]:
    """Forward ids that some backward node reads, sorted."""
    phase = problem.phase  # called once per closed plan: a tuple lookup beats building a set here
    reads = {u for v in range(problem.size) if phase[v] == BACKWARD for u in problem.inputs[v] if phase[u] == FORWARD}
    return tuple(sorted(reads))


def close(problem: RematProblem, kept: set[int] | tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Complete a kept set into a valid (kept, recomputed) pair.

    Every forward value the backward reads is kept or recomputed; recomputing a
    value needs its inputs kept or recomputed. Values that cannot run twice
    (``never_recompute``) and ``must_save`` values are kept when needed. Kept
    values that the backward does not need are dropped (they would cost memory
    for nothing).

    At most one value per storage is kept (see ``one_per_storage``): the
    other aliases of a kept storage are recomputed as views of it.

    Returns:
        (kept, recomputed), both sorted tuples of forward ids.
    """
    kept_set = set(kept) | set(problem.must_save)
    needed = bw_reads(problem)
    # Each round replaces a group of aliases by one value; a few rounds settle it.
    for _ in range(problem.size + 1):
        needed_kept, recomputed = _close(problem, kept_set, needed)
        canonical = one_per_storage(problem, needed_kept)
        if canonical == needed_kept:
            break
        kept_set = canonical
    return tuple(sorted(needed_kept)), tuple(sorted(recomputed))


def one_per_storage(problem: RematProblem, kept: set[int]) -> set[int]:
    """Replace aliases kept together by the storage they share.

    Two saved values that share a storage (a value and a view of it, or two
    views of one tensor) break the backward: AOTAutograd donates every saved
    tensor whose storage no input or output shares, and Inductor may write a
    kernel's output into a donated buffer at what it sees as the buffer's last
    use, while a later read of the other alias, a separate input to it, sees
    the overwritten memory (a silent wrong gradient). Keeping one value per
    storage and recomputing the other aliases as views inside the backward lets
    the compiler see the aliasing. The alias kept is one that cannot be
    recomputed (``never_recompute``, ``must_save``) if there is one, else the storage's owner
    when it may be kept, else the earliest alias. Two aliases that both cannot
    be recomputed stay kept; ``passes/invariants.py`` rejects such a plan when
    the storage is donated.
    """
    groups = alias_groups(problem, kept)
    if all(len(g) == 1 for g in groups.values()):
        return kept
    no_recompute = set(problem.never_recompute) | set(problem.must_save)
    may_keep = set(range(problem.size)) - set(problem.must_recompute)
    out = set(kept)
    for owner, members in groups.items():
        if len(members) == 1:
            continue
        forced = [v for v in members if v in no_recompute]
        if forced:
            keep = forced[0]
        else:
            keep = owner if problem.is_forward(owner) and owner in may_keep else members[0]
        out.difference_update(v for v in members if v not in no_recompute)
        out.add(keep)
    return out


def alias_groups(problem: RematProblem, values) -> dict[int, list[int]]:
    """``values`` by the storage they live in, leaving out storages a user output holds.

    Saved values that share a user output's storage are never donated to the
    backward (the user holds that memory), so they may stay kept together.
    """
    held = {problem.storage[o] for o in problem.fw_outputs}
    groups: dict[int, list[int]] = {}
    for v in sorted(values):
        if problem.storage[v] not in held:
            groups.setdefault(problem.storage[v], []).append(v)
    return groups


def _close(problem: RematProblem, kept_set: set[int], needed: tuple[int, ...]) -> tuple[set[int], set[int]]:
    """``close`` without the one-value-per-storage rule; ``needed`` is ``bw_reads(problem)``."""
    no_recompute = set(problem.never_recompute)
    phase = problem.phase  # once per closed plan: a tuple lookup beats building a set here
    needed_kept: set[int] = set()
    recomputed: set[int] = set()
    stack = list(needed)
    while stack:
        v = stack.pop()
        if v in needed_kept or v in recomputed:
            continue
        if v in kept_set or v in no_recompute:
            needed_kept.add(v)
            continue
        recomputed.add(v)
        stack.extend(u for u in problem.inputs[v] if phase[u] == FORWARD)
    return needed_kept, recomputed


def ancestors(problem: RematProblem, roots, within) -> set[int]:
    """``roots`` and their ancestors, walking only through ids in ``within``.

    Args:
        problem: the joint graph.
        roots: ids to start from; those outside ``within`` are skipped.
        within: ids the walk may visit (any container).

    Returns:
        The ids visited.

    Example:
        >>> ancestors(problem, problem.fw_outputs, problem.forward_ids())   # the forward's live part
    """
    seen: set[int] = set()
    stack = [r for r in roots if r in within]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        stack.extend(u for u in problem.inputs[v] if u in within and u not in seen)
    return seen


def _pending_ancestors(problem: RematProblem, v: int, needed: set[int], done: set[int]) -> set[int]:
    """``ancestors(problem, [v], needed - done)`` for ``v`` in ``needed - done``, without the copy.

    ``programs`` walks once per backward node while ``done`` grows: a copy of
    ``needed - done`` per walk made it quadratic in the graph size.
    """
    seen: set[int] = set()
    stack = [v]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        stack.extend(u for u in problem.inputs[x] if u in needed and u not in done and u not in seen)
    return seen


@dataclass(frozen=True)
class _BackwardPart:
    """What ``programs`` needs of a problem whatever the plan, found once per problem."""

    forward: frozenset[int]
    """The forward's ids."""
    reached: frozenset[int]
    """Ids the returned and handed gradients reach through non-forward ids alone."""
    doors: tuple[int, ...]
    """Forward ids that nodes of ``reached`` read (or that are roots): recomputing one opens a way on."""
    first_reader: int | None
    """The least id of ``reached`` (tangents aside) that reads a tangent."""


def _backward_part(problem: RematProblem) -> _BackwardPart:
    forward = problem.forward_ids()
    tangents = set(problem.tangents)
    roots = list(problem.bw_outputs + problem.handed)
    reached = ancestors(problem, roots, _Walkable(forward))
    doors = {r for r in roots if r in forward} | {u for v in reached for u in problem.inputs[v] if u in forward}
    readers = [v for v in reached - tangents if any(u in tangents for u in problem.inputs[v])]
    return _BackwardPart(forward, frozenset(reached), tuple(sorted(doors)), min(readers, default=None))


class _Walkable:
    """``ancestors``' ``within`` for ``programs``: ids outside ``forward`` or in ``recomputed``, less ``walked``
    (a container, so that no set of the problem's size is built per plan)."""

    def __init__(self, forward: frozenset[int], recomputed=(), walked=frozenset()) -> None:
        self.forward, self.recomputed, self.walked = forward, recomputed, walked

    def __contains__(self, v: object) -> bool:
        return (v not in self.forward or v in self.recomputed) and v not in self.walked


_BACKWARD_PARTS: PerProblem[_BackwardPart] = PerProblem(_backward_part)


def programs(problem: RematProblem, kept, recomputed) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Forward and backward programs (node ids in execution order).

    The forward runs every forward node that a user output or a kept value
    depends on, in topological order. The backward starts with the tangents;
    then, from the first node that reads a tangent on, each node runs after
    the nodes it needs that have not run yet (recomputed values and backward
    nodes that do not depend on a tangent are pulled in just before their
    first use). This is the order of PyTorch's
    ``reordering_to_mimic_autograd_engine``, which ``passes/apply.py`` runs on
    the real backward graph.
    """
    part = _BACKWARD_PARTS.get(problem)
    fw_nodes = part.forward
    forward = sorted(ancestors(problem, list(problem.fw_outputs) + list(kept), fw_nodes))
    tangents = list(problem.tangents)
    tangent_set = set(tangents)
    # What the gradients need: what they reach through the backward alone (the same for every plan),
    # and what they reach through the recomputed values (a walk from the recomputed "doors" on).
    recomputed = set(recomputed)
    doors = [u for u in part.doors if u in recomputed]
    extra = ancestors(problem, doors, _Walkable(fw_nodes, recomputed, part.reached))
    needed = (extra | part.reached) - tangent_set
    readers = [v for v in extra - tangent_set if any(u in tangent_set for u in problem.inputs[v])]
    if part.first_reader is not None:
        readers.append(part.first_reader)
    done: set[int] = set(tangents)
    backward: list[int] = list(tangents)
    if not readers:
        return tuple(forward), tuple(backward) + tuple(sorted(needed))
    inputs = problem.inputs

    def run(v: int) -> None:
        """Run ``v``, after what it needs that has not run (ids ascend: all of it is earlier)."""
        for u in inputs[v]:
            if u in needed and u not in done:
                break
        else:  # nothing pending (most nodes): ``v`` alone
            done.add(v)
            backward.append(v)
            return
        for u in sorted(_pending_ancestors(problem, v, needed, done)):
            done.add(u)
            backward.append(u)

    first = min(readers)
    for v in sorted(needed):
        if v >= first and v not in done:
            run(v)
    # Needed nodes that no node from the first tangent reader on leads to (a
    # returned gradient that depends on no tangent, placed before the first
    # tangent reader) run last: PyTorch's ordering inserts them when it
    # reaches the output node.
    for v in sorted(needed - done):
        run(v)
    return tuple(forward), tuple(backward)


@dataclass(frozen=True)
class Timeline:
    """Live bytes after each step of the forward then the backward program.

    ``steps[i]`` is (node id, phase, live bytes while the node runs: everything
    alive, its output and its scratch, before anything is freed). ``peak`` is the largest of them and of
    the backward's starting point. ``reused`` lists the in-place pairs
    (writer, buffer) the replay took.
    """

    steps: tuple[tuple[int, int, int], ...]
    peak: int
    peak_step: int
    kept_bytes: int
    reused: tuple[tuple[int, int], ...] = ()


def virtual(problem: RematProblem, kept) -> frozenset[int]:
    """Fused values that never exist in memory under a plan: neither kept nor returned."""
    if not problem.fused:
        return frozenset()
    storage = problem.storage
    held = (
        {storage[v] for v in kept} | {storage[v] for v in problem.fw_outputs} | {storage[v] for v in problem.bw_outputs}
    )
    return frozenset(v for v in problem.fused if v not in held)


def reads(problem: RematProblem, virtual_ids: frozenset[int]) -> tuple[tuple[int, ...], ...]:
    """The values each node reads from memory: a virtual value's own reads stand in for it
    (its consumers' kernels compute it from them), transitively. Each entry is a set of ids
    (order and repeats carry no meaning)."""
    if not virtual_ids:
        return problem.inputs
    storage = problem.storage
    virtual_of = [s in virtual_ids for s in storage]  # id -> it lives in a virtual value
    out: list[tuple[int, ...]] = []
    for ins in problem.inputs:
        for u in ins:
            if virtual_of[u]:
                break
        else:
            # Reads no virtual value: its own inputs (most nodes; every reader of this result
            # takes an entry as a set, so order and repeats do not matter).
            out.append(ins)
            continue
        got: set[int] = set()
        for u in ins:
            if virtual_of[u]:
                got.update(out[u])
            else:
                got.add(u)
        out.append(tuple(got))
    return tuple(out)


def liveness(problem: RematProblem, forward, backward, kept) -> Timeline:
    """Replay the two programs and return live bytes over time.

    Counted: every storage a program allocates, from the node that allocates
    it to the last use of any value aliasing it. Kept values live from the
    forward to their last backward use; user outputs (to the forward's end
    when ``outputs_released``) and gradients returned by the backward live to
    the end of the step; tangents are allocated when the
    backward starts. Fused values that are neither kept nor returned allocate
    nothing; what they read stays alive until their consumers run.
    """
    storage = problem.storage
    scratch = problem.scratch
    kept_set = set(kept)
    gone = virtual(problem, kept_set)
    inputs = reads(problem, gone)
    into: dict[int, list[int]] = {}
    for writer, buffer in problem.inplace:
        into.setdefault(writer, []).append(buffer)
    pinned = {storage[v] for v in problem.fw_outputs} | {storage[v] for v in problem.bw_outputs}
    steps: list[tuple[int, int, int]] = []
    live = 0
    peak = 0
    peak_step = -1

    def last_uses(program):
        # Steps come in order, so the latest write of each entry is its last use.
        ran = set(program) | kept_set
        last: dict[int, int] = {}
        for i, v in enumerate(program):
            last[storage[v]] = i
            for u in inputs[v]:
                if u in ran:
                    last[storage[u]] = i
        return last

    # Forward.
    fw_last = last_uses(forward)
    held = {storage[v] for v in kept_set} | pinned
    alive: dict[int, int] = {}
    frees: dict[int, list[int]] = {}
    for s, i in fw_last.items():
        if s not in held:
            frees.setdefault(i, []).append(s)
    reused: list[tuple[int, int]] = []

    def allocate(v: int, i: int, last: dict[int, int], keep: set[int]) -> int:
        """Bytes ``v`` adds: 0 when it writes into a buffer that dies at this step."""
        for u in into.get(v, ()):
            if u in alive and last.get(u) == i and u not in keep and alive[u] == problem.nbytes[v]:
                alive[v] = alive.pop(u)
                reused.append((v, u))
                return 0
        alive[v] = problem.nbytes[v]
        return problem.nbytes[v]

    for i, v in enumerate(forward):
        if problem.nbytes[v] and storage[v] == v and v not in gone:
            live += allocate(v, i, fw_last, held)
        during = live + (scratch[v] if scratch else 0)
        steps.append((v, FORWARD, during))
        if during > peak:
            peak, peak_step = during, len(steps) - 1
        for s in frees.get(i, ()):
            live -= alive.pop(s, 0)

    kept_bytes = sum(alive.get(s, 0) for s in {storage[v] for v in kept_set})
    # The earlier calls of the graph hold their kept sets through all of this one (their
    # outputs are the caller's: counted with what else the step holds, not here).
    outputs = {storage[v] for v in problem.fw_outputs}
    by_copies = problem.copies * sum(alive.get(s, 0) for s in {storage[v] for v in kept_set} - outputs)
    # Backward: kept storages are freed after their last backward use.
    bw_last = last_uses(backward)
    if problem.outputs_released:
        pinned = {storage[v] for v in problem.bw_outputs}
    frees = {}
    for s, i in bw_last.items():
        if s not in pinned:
            frees.setdefault(i, []).append(s)
    for s in list(alive):
        if s not in pinned and s not in bw_last:
            live -= alive.pop(s)
    # A saved tensor that is also a user output is not donated to the backward.
    undonated = pinned | {storage[v] for v in problem.fw_outputs}
    for i, v in enumerate(backward):
        if problem.nbytes[v] and storage[v] == v and v not in gone:
            live += allocate(v, i, bw_last, undonated)
        during = live + (scratch[v] if scratch else 0)
        steps.append((v, BACKWARD, during))
        if during > peak:
            peak, peak_step = during, len(steps) - 1
        for s in frees.get(i, ()):
            live -= alive.pop(s, 0)
    if by_copies:
        steps = [(v, phase, live + by_copies) for v, phase, live in steps]
        peak += by_copies
    return Timeline(tuple(steps), peak, peak_step, kept_bytes, tuple(reused))


def evaluate(problem: RematProblem, kept) -> tuple[tuple[int, ...], tuple[int, ...], int, float]:
    """Close a kept set and simulate it: (kept, recomputed, peak bytes, recompute seconds).

    Remembered per problem: the solves of one planning simulate many of the same kept sets
    (on a 32-layer Llama-3-8B-shaped graph, 348 simulations took 41 s).
    """
    seen = _EVALUATED.get(problem)
    key = tuple(sorted(set(kept)))
    if key not in seen:
        kept_c, recomputed = close(problem, key)
        forward, backward = programs(problem, kept_c, recomputed)
        peak = liveness(problem, forward, backward, kept_c).peak
        seen[key] = (kept_c, recomputed, peak, sum(problem.seconds[v] for v in recomputed))
    return seen[key]


_EVALUATED: PerProblem[dict] = PerProblem(lambda problem: {})


def decision(
    problem: RematProblem,
    kept,
    budget: int | None,
    solver: str,
    solve_seconds: float = 0.0,
    gap: float | None = None,
    note: str = "",
) -> Decision:
    """Build a Decision from a kept set: close it, simulate it, judge it against the budget."""
    kept_c, recomputed, peak, seconds = evaluate(problem, kept)
    return Decision(
        kept=kept_c,
        recomputed=recomputed,
        peak_bytes=peak,
        recompute_seconds=seconds,
        feasible=budget is None or peak <= budget,
        solver=solver,
        solve_seconds=solve_seconds,
        gap=gap,
        note=note,
    )
