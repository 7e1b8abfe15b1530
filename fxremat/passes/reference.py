"""PyTorch's own partition of a joint graph: what plain ``torch.compile`` would save for the backward.

With no budget, the planner judges this kept set beside its own plans, so that
the default is never worse in memory than what users already have: PyTorch's
min-cut partitioner recomputes the cheap fusible values it can (Inductor runs
them inside the backward's kernels), which a plan chosen only within a time
slack may not.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import replace

import torch.fx as fx

from .._torch_compat import min_cut_partition
from .cost import NodeCost
from .forked import Child, fork_call, workers
from .opinfo import is_tagged_pointwise, is_view
from .problem import ProblemGraph
from ..solvers.schedule import decision
from ..solvers.types import FORWARD, Decision, RematProblem

__all__ = ["Reference", "as_decision", "pointwise_only"]

log = logging.getLogger("fxremat")


def _copy(joint: fx.GraphModule) -> fx.Graph:
    """A copy of ``joint``'s graph with its own nodes (meta shared): PyTorch's partitioner edits the graph it gets."""
    graph = fx.Graph()
    out = graph.graph_copy(joint.graph, {})
    graph.output(out)
    return graph


class Reference:
    """PyTorch's partition of a joint graph, run when first asked for (``saved``), or begun ahead in a
    forked child (``start``).

    The graph is copied when this is made: the planner then edits its own joint graph.
    Its module (Python code generated for the whole graph) is built only when asked for:
    under a budget it is needed only for the least-memory plan.
    """

    def __init__(self, joint: fx.GraphModule, joint_inputs, num_fwd_outputs: int, static_indices: list[int]) -> None:
        self._args = (joint, _copy(joint), joint_inputs, num_fwd_outputs, static_indices)
        self._saved: tuple[str, ...] | None = None
        self._done = False
        self._child: Child | None = None
        self._ended: weakref.finalize | None = None

    def start(self) -> None:
        """Begin PyTorch's partition in a forked child (``passes/forked.py``), so that it runs on another
        core while this process searches: with no budget it is always asked for, and it was most of
        the search on an 8B-shaped model (4.8 of 6.9 s at 32 layers). The child runs the same call
        ``saved`` would, so the answer does not depend on whether one was forked. Does nothing where
        no child may be forked, or once started or answered."""
        if self._done or self._child is not None or workers() < 2:
            return
        root, graph, *rest = self._args
        try:
            self._child = fork_call(lambda: _pytorch_saved(fx.GraphModule(root, graph), *rest), "PyTorch's partition")
        except OSError as e:  # no process to spare (EAGAIN, ENOMEM): run here when asked
            log.info("fxremat: could not fork a child for PyTorch's partition (%s); running it here", e)
            return
        # A reference dropped unasked (the search failed, or found its plan elsewhere) ends its child.
        self._ended = weakref.finalize(self, self._child.cancel)

    def saved(self) -> tuple[str, ...] | None:
        """Names of the values PyTorch's min-cut partitioner saves for the backward; None if it fails."""
        if self._done:
            return self._saved
        self._done = True
        ok, answer = False, None
        if self._child is not None and self._ended is not None:
            self._ended.detach()
            ok, answer = self._child.result()
            self._child = None
            if not ok:
                log.info("fxremat: PyTorch's partition in a forked child failed (%s); running it here", answer)
        if not ok:
            root, graph, *rest = self._args
            answer = _pytorch_saved(fx.GraphModule(root, graph), *rest)
        self._saved = answer  # type: ignore[assignment]
        self._args = None  # type: ignore[assignment]
        return self._saved


def _pytorch_saved(
    joint: fx.GraphModule, joint_inputs, num_fwd_outputs: int, static_lifetime_input_indices: list[int]
) -> tuple[str, ...] | None:
    try:
        fw, _ = min_cut_partition(
            joint,
            joint_inputs,
            compiler="inductor",
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )
    except Exception as exc:  # noqa: BLE001 - a reference only: planning goes on without it
        log.debug("fxremat: PyTorch's partition of this graph failed (%s: %s)", type(exc).__name__, exc)
        return None
    output = next(iter(fw.graph.find_nodes(op="output")))
    saved = output.args[0][num_fwd_outputs:]
    return tuple(n.name for n in saved if isinstance(n, fx.Node))


def as_decision(
    graph: ProblemGraph,
    names: tuple[str, ...],
    solver: str = "pytorch:mincut",
    note: str = "PyTorch's own partition (plain torch.compile's)",
    budget: int | None = None,
) -> Decision:
    """The kept set of those names in the planner's problem, closed and simulated.

    PyTorch's partitioner may save a value the planner's problem places in the backward
    (only the backward uses it, and it needs no gradient): the transpose of a linear
    layer's input for its weight gradient, a layer norm's ``rsqrt / n``. PyTorch computes
    it in the forward; the planner keeps the forward values it is computed from instead
    (the same storage for a view). Dropping such a name made the plan recompute what
    PyTorch keeps: on a tiny HF GPT-2, four ``addmm`` more in the backward than plain
    ``torch.compile``'s.
    """
    problem = graph.problem
    index = {n: i for i, n in enumerate(graph.nodes)}
    wanted = set(names)
    kept: set[int] = set()
    for i, n in enumerate(graph.nodes):
        if n.name in wanted:
            kept.update([i] if problem.phase[i] == FORWARD else _forward_sources(n, index, problem))
    return decision(problem, sorted(kept), budget, solver, note=note)


def _forward_sources(node: fx.Node, index: dict[fx.Node, int], problem: RematProblem) -> set[int]:
    """The forward values (problem indices) ``node`` is computed from, through nodes outside the forward."""
    found: set[int] = set()
    seen = {node}
    todo = [node]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg in seen:
                continue
            seen.add(arg)
            i = index.get(arg)
            if i is None:
                continue  # a graph input (a parameter, the batch): nothing to keep
            if problem.phase[i] == FORWARD:
                found.add(i)
            else:
                todo.append(arg)
    return found


def pointwise_only(graph: ProblemGraph, costs: dict[fx.Node, NodeCost]) -> RematProblem:
    """The problem with every forward value but pointwise ops and views kept: the class of work
    PyTorch's partitioner recomputes, which Inductor runs inside the backward's kernels."""
    problem = graph.problem
    heavy = {
        i
        for i, n in enumerate(graph.nodes)
        if problem.phase[i] == FORWARD
        and n.op == "call_function"
        and not is_tagged_pointwise(n)
        and not is_view(n, costs)
    }
    return replace(problem, never_recompute=tuple(sorted(heavy | set(problem.never_recompute))))
