"""Recompute a value a second time where its lifetime spans the backward's peak.

A plan recomputes each value once, just before its first use, and frees it
after its last. A value read both before and after the backward's peak (an
attention block's projection read when the block's output is recomputed and
again by its own gradient) is then held across the peak. Recomputing it again
just before its later readers frees it over the peak: Chen et al.'s nested
checkpoints, where a segment's inner values run once to reach the next
checkpoint and again for their own gradients.

This module works on the programs that run, as a ``RematProblem`` whose ids are
in execution order (``passes/simulate.program_problem``: the forward's ids,
then the backward's), so a copy inserted at an id runs at that point.
``split_lifetimes`` searches greedily, one split at a time, for the splits
that lower the replayed peak; ``with_split`` applies one. ``passes/twice.py``
makes the same edits on the backward GraphModule. The search is bounded by
work (simulations x nodes), never by the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import schedule
from .schedule import Timeline, liveness, reads, virtual
from .types import BACKWARD, FORWARD, RematProblem

__all__ = [
    "Split",
    "with_split",
    "split_lifetimes",
    "program_of",
    "nested_peak",
    "nested_least",
    "TWICE_MAX_WORK",
    "TWICE_MAX_SPLITS",
    "NESTED_MAX_WORK",
]

# Simulations x program nodes one search may spend: about 2 s on 1,000- to 1,500-node
# programs on this project's 2-core machine (liveness replays ~1.5 ms per 1,000 nodes). Programs
# Inductor fuses replay slower: a trial on HF GPT-2's 1,237-node programs (benchmark size) took
# about 6 ms with its split, so a nested search there spends ~6 s on its work.
TWICE_MAX_WORK = 1_500_000
# Splits one plan may take; each adds a recomputation (and Inductor code) to the backward.
TWICE_MAX_SPLITS = 64
# FLOPs all copies may add, as a share of the forward's: at most one more forward's worth of compute
# (Chen et al.'s two-level nested checkpoints cost about that).
TWICE_MAX_FLOPS = 1.0
# Values tried per round of ``split_lifetimes``, largest first: the largest free the most.
TWICE_CANDIDATES = 6
# Work of the whole nested least-peak search (``nested_least``): 4.5 s on HF GPT-2's 1,136-node joint graph
# (4 layers), which reached the same plan with twice the work; a 32-layer chain reached it with 1M. These
# seconds predate faster splits and replays (856972e): the same searches on seven zoo graphs took 17.4 s
# instead of 33.8 s, with the same results.
NESTED_MAX_WORK = 1_500_000


@dataclass(frozen=True)
class Split:
    """Copies of ``copies`` run just before id ``at``; every node from ``at`` on reads the copies.

    Ids are those of the problem the split applies to.
    """

    at: int
    copies: tuple[int, ...]


def with_split(problem: RematProblem, split: Split) -> RematProblem:
    """``problem`` with ``split``'s copies inserted at ``split.at``.

    Ids before ``at`` keep their number, the copies take ``at ..``, and later ids
    shift by the number of copies. Every node from ``at`` on that read a copied
    value reads its copy (and lives in the copy's storage when it aliased one).

    Returns:
        The new problem; its backward program is ``range(offset, size)`` as before.
    """
    at, copies = split.at, split.copies
    k = len(copies)
    copy_of = {c: at + j for j, c in enumerate(copies)}
    # Ids before ``at`` keep their number, and so do their inputs and storage (all earlier ids).
    moved = list(range(at)) + list(range(at + k, problem.size + k))  # id -> new id
    late = moved[:]  # what a node from ``at`` on reads in place of an id: its copy when it has one
    for c, j in copy_of.items():
        late[c] = j
    new = moved.__getitem__

    def spliced(values: tuple) -> tuple:
        return values[:at] + tuple(values[c] for c in copies) + values[at:]

    inputs = list(problem.inputs[:at])
    inputs += [tuple(sorted(copy_of.get(u, u) for u in problem.inputs[c])) for c in copies]
    inputs += [tuple(sorted(map(late.__getitem__, problem.inputs[i]))) for i in range(at, problem.size)]
    storage = list(problem.storage[:at])
    storage += [copy_of.get(problem.storage[c], problem.storage[c]) for c in copies]
    storage += map(late.__getitem__, problem.storage[at:])
    copied, fused = set(copies), set(problem.fused)
    inplace = []
    for w, b in problem.inplace:
        if w in copied:
            continue  # a copy writes into no dying buffer: Inductor plans its own
        inplace.append((new(w), late[b] if w >= at else new(b)))
    return problem.derived(
        names=spliced(problem.names),  # a copy keeps its value's name
        phase=problem.phase[:at] + (BACKWARD,) * k + problem.phase[at:],
        inputs=tuple(inputs),
        nbytes=spliced(problem.nbytes),
        storage=tuple(storage),
        seconds=spliced(problem.seconds),
        flops=spliced(problem.flops),
        fw_outputs=tuple(new(i) for i in problem.fw_outputs),
        bw_outputs=tuple(new(i) for i in problem.bw_outputs),
        tangents=tuple(new(i) for i in problem.tangents),
        must_save=tuple(new(i) for i in problem.must_save),
        never_recompute=tuple(new(i) for i in problem.never_recompute),
        must_recompute=tuple(new(i) for i in problem.must_recompute),
        layer=spliced(problem.layer) if problem.layer else (),
        scratch=spliced(problem.scratch) if problem.scratch else (),
        fused=tuple(sorted([new(i) for i in problem.fused] + [copy_of[c] for c in copies if c in fused])),
        inplace=tuple(sorted(set(inplace))),
        handed=tuple(new(i) for i in problem.handed),
    )


def _replay(problem: RematProblem, offset: int, kept) -> Timeline:
    return liveness(problem, tuple(range(offset)), tuple(range(offset, problem.size)), kept)


class _Round:
    """What one round of the search knows about the current program: readers, last uses, the peak."""

    def __init__(self, problem: RematProblem, offset: int, kept, timeline: Timeline, again: frozenset[int]):
        self.problem, self.offset, self.again = problem, offset, again
        self.peak_id = timeline.peak_step  # steps are ids: the programs are range(offset), range(offset, size)
        self.gone = virtual(problem, set(kept))
        self.reads = reads(problem, self.gone)
        self.readers: list[list[int]] = [[] for _ in range(problem.size)]
        for v in range(problem.size):
            for u in problem.inputs[v]:
                self.readers[u].append(v)
        storage = problem.storage
        self.last = [-1] * problem.size  # last id reading each storage (through fused values too)
        for v in range(problem.size):  # in order: the latest write is the last read
            for u in self.reads[v]:
                self.last[storage[u]] = v
        self.read_at_peak = {storage[u] for u in self.reads[self.peak_id]} | {storage[self.peak_id]}
        self.returned = frozenset(problem.bw_outputs)

    def candidates(self) -> list[int]:
        """Storage owners recomputed in the backward, alive over the peak, not read by it; largest first."""
        p, problem = self.peak_id, self.problem
        pinned = set(problem.bw_outputs) | set(problem.fw_outputs)
        out = []
        for s in range(self.offset, p):
            if (
                s in self.again
                and problem.storage[s] == s
                and problem.nbytes[s]
                and s not in self.gone
                and s not in pinned
                and self.last[s] > p
                and s not in self.read_at_peak
            ):
                out.append(s)
        return sorted(out, key=lambda s: (-problem.nbytes[s], s))

    def split(self, s: int) -> Split | None:
        """Copies that free storage ``s`` over the peak, or None when they cannot."""
        p, problem, storage = self.peak_id, self.problem, self.problem.storage
        group = [x for x in range(s, p + 1) if storage[x] == s and any(r > p for r in self.readers[x])]
        # Fused values read after the peak that compute from ``s`` run again inside their copies' kernels.
        group += [
            y
            for y in range(s, p + 1)
            if y in self.gone and s in {storage[u] for u in self.reads[y]} and any(r > p for r in self.readers[y])
        ]
        copies: set[int] = set()
        todo = sorted(set(group))
        while todo:
            x = todo.pop()
            if x in copies:
                continue
            if x not in self.again:
                return None  # a value that may not run twice would have to
            copies.add(x)
            needs = list(problem.inputs[x])
            if storage[x] != x:
                needs.append(storage[x])
            for u in needs:
                if u < self.offset or u in copies:
                    continue  # a forward value (kept) or already copied
                dead = self.last[storage[u]] <= p
                if u in self.gone or storage[u] == s or dead:
                    if storage[u] in self.returned or u in self.returned:
                        return None
                    todo.append(u)
        late = [r for c in copies for r in self.readers[c] if r > p]
        if not late:
            return None
        return Split(min(late), tuple(sorted(copies)))


def split_lifetimes(
    problem: RematProblem, offset: int, kept, again, max_splits: int = TWICE_MAX_SPLITS
) -> tuple[RematProblem, tuple[Split, ...], Timeline]:
    """``_split_lifetimes`` within the default work, without the work count."""
    problem, splits, timeline, _ = _split_lifetimes(problem, offset, kept, again, TWICE_MAX_WORK, max_splits)
    return problem, splits, timeline


def _split_lifetimes(
    problem: RematProblem, offset: int, kept, again, max_work: int, max_splits: int = TWICE_MAX_SPLITS
) -> tuple[RematProblem, tuple[Split, ...], Timeline, int]:
    """Greedily split the lifetimes that span the backward's peak, while the peak falls.

    Each round looks at the step where the replay peaks; for the values recomputed in
    the backward that are alive there but not read there (the ``TWICE_CANDIDATES``
    largest), it tries recomputing each (and what it needs that died before) again
    after the peak, and takes the split that lowers the live bytes at that step most
    without raising the peak (ties: fewer copies, then the lowest id). A plateau of
    equal peaks is lowered one step at a time. The copies' FLOPs are held to
    ``TWICE_MAX_FLOPS`` times the forward's: each split copies the chain from the last
    value alive, and without a bound a long chain is copied once per split (a 32-layer
    chain of linears ran 5x slower, 60 splits).

    Args:
        problem: the programs as one problem, ids in execution order.
        offset: the number of forward ids (the backward is ``range(offset, size)``).
        kept: forward ids the forward hands the backward.
        again: backward ids that may run a second time (recomputed forward values:
            deterministic, no mutation, independent of the tangents).
        max_work: simulations x nodes the search may spend.
        max_splits: the most splits to take (at most ``TWICE_MAX_SPLITS``).

    Returns:
        (the problem with the splits applied, the splits in the order applied, its replay,
        the work spent).
    """
    timeline = _replay(problem, offset, kept)
    splits: list[Split] = []
    again_ids = frozenset(again)
    work = 0
    flops_left = TWICE_MAX_FLOPS * sum(problem.flops[:offset])
    while len(splits) < min(max_splits, TWICE_MAX_SPLITS) and timeline.peak_step >= offset:
        state = _Round(problem, offset, kept, timeline, again_ids)
        p = state.peak_id
        here = timeline.steps[p][2]
        best = None
        for s in state.candidates()[:TWICE_CANDIDATES]:
            split = state.split(s)
            if split is None or sum(problem.flops[c] for c in split.copies) > flops_left:
                continue
            work += problem.size
            if work > max_work:
                break
            trial = with_split(problem, split)
            t = _replay(trial, offset, kept)
            if t.peak > timeline.peak:
                continue
            score = (t.peak, t.steps[p][2], len(split.copies), s)
            if score[:2] < (timeline.peak, here) and (best is None or score < best[0]):
                best = (score, split, trial, t)
        if best is None:
            break
        _, split, problem, timeline = best
        flops_left -= sum(problem.flops[c] for c in range(split.at, split.at + len(split.copies)))
        splits.append(split)
        shift = len(split.copies)
        again_ids = frozenset(
            [i if i < split.at else i + shift for i in again_ids] + list(range(split.at, split.at + shift))
        )
        if work > max_work:
            break
    return problem, tuple(splits), timeline, work


# --------------------------------------------------------------------------
# The plan's programs as one problem, and the least peak with splits
# --------------------------------------------------------------------------


def program_of(problem: RematProblem, kept, recomputed) -> tuple[RematProblem, int, tuple[int, ...], tuple[int, ...]]:
    """A plan's programs (``schedule.programs``) as one problem whose ids are in execution order.

    A value computed in the forward and recomputed in the backward gets an id in each;
    backward nodes read the backward's copy of a value when there is one.

    Returns:
        (the problem, the number of forward ids, the kept values' ids, the ids of the
        backward's recomputed values that may run a second time).
    """
    forward, backward = schedule.programs(problem, kept, recomputed)
    order = list(forward) + list(backward)
    offset = len(forward)
    in_fw = {v: i for i, v in enumerate(forward)}
    in_bw = {v: offset + j for j, v in enumerate(backward)}
    inputs: list[tuple[int, ...]] = []
    storage: list[int] = []
    here = dict(in_fw)  # where each value is read from: its backward copy once one has run
    for i, v in enumerate(order):
        inputs.append(tuple(sorted({here[u] for u in problem.inputs[v] if u in here})))
        owner = problem.storage[v]
        storage.append(i if owner == v else here.get(owner, i))
        if i >= offset:
            here[v] = i
    fused = set(problem.fused)
    no_twice = set(problem.never_recompute)
    pairs = []
    for w, b in problem.inplace:
        if w in in_fw and b in in_fw and in_fw[b] < in_fw[w]:
            pairs.append((in_fw[w], in_fw[b]))
        if w in in_bw:  # the buffer as the backward's run of ``w`` reads it
            buffer = in_bw[b] if b in in_bw and in_bw[b] < in_bw[w] else in_fw.get(b)
            if buffer is not None and storage[buffer] == buffer:
                pairs.append((in_bw[w], buffer))
    out = RematProblem(
        names=tuple(problem.names[v] for v in order),
        phase=tuple([FORWARD] * offset + [BACKWARD] * len(backward)),
        inputs=tuple(inputs),
        nbytes=tuple(problem.nbytes[v] if storage[i] == i else 0 for i, v in enumerate(order)),
        storage=tuple(storage),
        seconds=tuple(problem.seconds[v] for v in order),
        flops=tuple(problem.flops[v] for v in order),
        fw_outputs=tuple(sorted(in_fw[v] for v in problem.fw_outputs if v in in_fw)),
        bw_outputs=tuple(sorted(in_bw[v] for v in problem.bw_outputs if v in in_bw)),
        tangents=tuple(in_bw[v] for v in problem.tangents if v in in_bw),
        scratch=tuple(problem.scratch[v] for v in order) if problem.scratch else (),
        fused=tuple(i for i, v in enumerate(order) if v in fused and storage[i] == i),
        outputs_released=problem.outputs_released,
        inplace=tuple(sorted(set(pairs))),
        copies=problem.copies,
        handed=tuple(sorted(in_bw[v] for v in problem.handed if v in in_bw)),
    )
    again = tuple(offset + j for j, v in enumerate(backward) if problem.phase[v] == FORWARD and v not in no_twice)
    return out, offset, tuple(sorted(in_fw[v] for v in kept if v in in_fw)), again


def nested_peak(problem: RematProblem, kept, max_work: int = TWICE_MAX_WORK) -> tuple[int, int, int]:
    """The replayed peak of ``kept``'s plan after ``split_lifetimes``: (peak, splits, work spent)."""
    kept_c, recomputed = schedule.close(problem, kept)
    program, offset, program_kept, again = program_of(problem, kept_c, recomputed)
    _, splits, timeline, work = _split_lifetimes(program, offset, program_kept, again, max_work)
    return timeline.peak, len(splits), work + program.size


def nested_least(
    problem: RematProblem, start, no_keep=(), max_work: int = NESTED_MAX_WORK
) -> tuple[tuple[int, ...], int, int]:
    """The least peak with values recomputed twice: kept values dropped greedily from ``start``.

    A kept value dropped is recomputed from an earlier one; alone that lengthens the
    recomputation the backward holds at once (and the peak rises), but with its
    lifetimes split (``split_lifetimes``) the recomputed segment is held a piece at a
    time: Chen et al.'s nested checkpoints. Each pass tries dropping each kept value,
    largest first, and keeps the drop when the split plan's peak falls; passes repeat
    while one falls, for at most ``max_work`` simulations x nodes.

    Args:
        problem: the joint graph.
        start: the kept set to start from (the least-peak plan's).
        no_keep: values never dropped (must-save values stay kept by ``schedule.close``).
        max_work: the work the whole search may spend.

    Returns:
        (kept set, its peak with splits, splits taken).
    """
    kept, _ = schedule.close(problem, start)
    spent = 0
    peak, count, work = nested_peak(problem, kept, max_work)
    spent += work
    must = set(problem.must_save) | set(no_keep)
    improved = True
    while improved and spent < max_work:
        improved = False
        for v in sorted(kept, key=lambda v: (-problem.nbytes[problem.storage[v]], v)):
            if v in must or v not in kept or spent >= max_work:
                continue
            trial, _ = schedule.close(problem, set(kept) - {v})
            if set(trial) >= set(kept):
                continue  # dropping it needs it (or a larger set) kept
            p, c, work = nested_peak(problem, trial, max_work - spent)
            spent += work
            if p < peak:
                kept, peak, count, improved = trial, p, c, True
    return tuple(kept), peak, count
