"""The Plan: what fxremat chose for one compiled graph, and a readable report."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .budget import format_bytes

if TYPE_CHECKING:
    from .solvers.types import RematProblem

__all__ = ["ValueRecord", "NodeRecord", "Plan", "PLAN_SCHEMA", "fingerprint"]


@dataclass(frozen=True)
class ValueRecord:
    """One forward value the plan keeps or recomputes.

    Attributes:
        name: the fx node name of the value in the joint graph.
        op: short op name (``"aten.mm"``, ``"getitem"``, ...).
        module: path of the module it came from (``""`` when unknown).
        nbytes: bytes of storage this value accounts for: each storage counts
            once per list (on its owner, or on its first view when the owner
            is not listed), so the column sums to the list's total.
        flops: floating-point operations to compute it once.
        seconds: estimated (roofline) time to compute it once.
    """

    name: str
    op: str
    module: str
    nbytes: int
    flops: int
    seconds: float


@dataclass(frozen=True)
class NodeRecord:
    """One node of the joint graph, for graph dumps.

    Attributes:
        name: the fx node name.
        op: short op name (``"aten.mm"``, ``"getitem"``, ...).
        module: path of the module it came from (``""`` when unknown).
        role: ``"kept"`` or ``"recomputed"`` for forward values the backward
            needs, else ``"forward"`` or ``"backward"``.
        nbytes: bytes of the storage the node allocates (0 for views and aliases).
        inputs: names of the nodes it reads, in argument order (graph inputs omitted).
    """

    name: str
    op: str
    module: str
    role: str
    nbytes: int
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """The plan chosen for one graph.

    Attributes:
        graph: a name for the graph (``"graph 0"``, ...).
        budget: the budget in bytes, or None (no budget: the least peak within
            ``time_slack`` of the fastest plan's estimated time).
        predicted_peak: peak bytes of the step (above the pre-step baseline):
            liveness of the exact forward and backward programs; under
            ``inner="inductor"`` the replay of the program Inductor generates for
            them (``passes/inductor_memory.py``).
        saved_bytes: bytes saved from the forward for the backward.
        recompute_flops / recompute_seconds: cost of the recomputation (estimated).
        solver: which solver produced the decision.
        solve_seconds: time spent choosing (solver loop only).
        kept / recomputed: per-value records, in graph order.
        fastest_peak: predicted peak of the fastest plan (nothing recomputed when possible).
        grad_bytes / tangent_bytes / output_bytes: parts of the peak that no plan changes.
        feasible: False when the budget could not be met and on_infeasible="min".
        gap: the solver's relative optimality gap: 0.0 when the plan is proven
            the fastest that fits, None when no bound is known.
        note: anything a user should know.
        pass_seconds: time of each pass, by name.
        num_nodes: nodes of the joint graph that were planned.
        timeline: predicted live bytes after each node of the forward then the backward.
        forward_code / backward_code: Python source of the final programs.

    Example:
        >>> plan = fxremat.explain(model, x, budget="2GiB")   # or fxremat.plans()[-1]
        >>> plan.predicted_peak <= plan.budget
        True
        >>> for module, kept, recomputed, flops, seconds in plan.by_module():
        ...     print(module, fxremat.format_bytes(kept), fxremat.format_bytes(recomputed))
    """

    graph: str
    budget: int | None
    predicted_peak: int
    saved_bytes: int
    recompute_flops: int
    recompute_seconds: float
    solver: str
    solve_seconds: float
    kept: tuple[ValueRecord, ...]
    recomputed: tuple[ValueRecord, ...]
    fastest_peak: int = 0
    grad_bytes: int = 0
    tangent_bytes: int = 0
    output_bytes: int = 0
    feasible: bool = True
    gap: float | None = None
    note: str = ""
    pass_seconds: dict = field(default_factory=dict)
    num_nodes: int = 0
    timeline: tuple[tuple[str, str, int], ...] = ()
    """(node name, "forward" or "backward", live bytes) for each node of the programs that run."""
    forward_code: str = ""
    backward_code: str = ""
    nodes: tuple[NodeRecord, ...] = ()
    """The joint graph (graph inputs omitted), with each node's role in the plan."""
    input_bytes: int = 0
    """Parameters, buffers and inputs the graph reads: they exist before the step."""
    largest: tuple[str, str, int] = ("", "", 0)
    """(name, module, bytes) of the largest tensor the step allocates (logits, for a language model)."""
    released_peak: int = 0
    """Predicted peak of the same programs when the caller drops the forward's outputs before the
    backward (``model(x).loss``); equal to ``predicted_peak`` when the plan assumed that."""
    accumulating_peak: int = 0
    """``predicted_peak`` of a step whose parameters' ``.grad`` already exist (gradient accumulation,
    ``zero_grad(set_to_none=False)``): each gradient the backward hands over is added in and freed
    as it is made (``Options.hand_over_grads``). ``predicted_peak`` keeps them to the end (new
    ``.grad`` tensors), an upper bound for both."""
    released_accumulating_peak: int = 0
    """``released_peak`` with the gradients added into existing ``.grad`` as they are made."""
    reserved_bytes: int = 0
    """Bytes of the budget left for memory the step holds outside this graph (``Options.reserve``;
    under FSDP2, its unsharded parameters and gradient buffers): the graph was planned under the rest."""
    chunked: tuple[str, ...] = ()
    """One line per loss computed a chunk of tokens at a time (``Options.chunk_loss``): where, how many
    chunks, the least peak planned without chunking when known, and the time it adds."""
    again: tuple[str, ...] = ()
    """Values the backward recomputes a second time, after its peak (nested checkpoints): the least-memory
    plan frees them over the peak and computes them again for their later readers."""
    references: dict = field(default_factory=dict)
    """Predicted timelines of reference policies: name -> ((phase, live bytes), ...)."""
    problem: RematProblem | None = field(default=None, repr=False, compare=False)
    """The solver's RematProblem for this graph (for ``fxremat.pareto``); not saved."""

    def summary(self) -> str:
        """One line: budget, predicted peak, kept and recomputed totals, solver.

        Returns:
            The line that starts ``str(plan)``.

        Example:
            >>> print(plan.summary())  # doctest: +SKIP
            graph 0: budget 2.00 GiB, predicted peak 1.93 GiB, saved 1.20 GiB in 212 values, ...
        """
        budget = "none" if self.budget is None else format_bytes(self.budget)
        return (
            f"{self.graph}: budget {budget}, predicted peak {format_bytes(self.predicted_peak)}, "
            f"saved {format_bytes(self.saved_bytes)} in {len(self.kept)} values, "
            f"recomputed {len(self.recomputed)} values ({self.recompute_flops / 1e9:.3f} GFLOP, "
            f"~{self.recompute_seconds * 1e3:.2f} ms), solver {self.solver} in {self.solve_seconds * 1e3:.0f} ms"
        )

    def fingerprint(self) -> str:
        """A short hash of the kept values' names: equal on every rank that runs the same plan.

        Returns:
            16 hex digits.

        Example:
            >>> fxremat.plans()[-1].fingerprint()  # doctest: +SKIP
            '3f1c0a9d2b7e4c61'
        """
        return fingerprint([rec.name for rec in self.kept])

    def by_module(self) -> list[tuple[str, int, int, int, float]]:
        """Kept and recomputed totals per module, the table of ``str(plan)``.

        Returns:
            Rows ``(module, kept bytes, recomputed bytes, recompute FLOPs,
            recompute seconds)``, in order of each module's first kept (then
            recomputed) value; ``"<top>"`` for values outside any submodule.

        Example:
            >>> recompute_heavy = max(plan.by_module(), key=lambda row: row[4])[0]
        """
        rows: dict[str, list] = {}
        for rec in self.kept:
            rows.setdefault(rec.module or "<top>", [0, 0, 0, 0.0])[0] += rec.nbytes
        for rec in self.recomputed:
            row = rows.setdefault(rec.module or "<top>", [0, 0, 0, 0.0])
            row[1] += rec.nbytes
            row[2] += rec.flops
            row[3] += rec.seconds
        return [(m, *rows[m]) for m in rows]

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.note:
            lines.append(f"note: {self.note}")
        if self.again:
            shown = ", ".join(self.again[:8]) + (f", ... ({len(self.again)} in all)" if len(self.again) > 8 else "")
            lines.append(f"recomputed twice (again after the backward's peak): {shown}")
        header = f"{'module':<40} {'kept':>12} {'recomputed':>12} {'recompute GFLOP':>16} {'est. ms':>9}"
        lines += ["", header, "-" * len(header)]
        for module, kept, rec, flops, secs in self.by_module():
            lines.append(
                f"{module[-40:]:<40} {format_bytes(kept):>12} {format_bytes(rec):>12} {flops / 1e9:>16.4f} {secs * 1e3:>9.3f}"
            )
        lines += [
            "",
            "memory anatomy of the step (above what exists before it):",
            f"  weights and inputs      {format_bytes(self.input_bytes):>12}  (before the step: not counted)",
            f"  saved for backward      {format_bytes(self.saved_bytes):>12}",
            f"  forward outputs         {format_bytes(self.output_bytes):>12}",
            f"  gradient inputs         {format_bytes(self.tangent_bytes):>12}",
            f"  gradients returned      {format_bytes(self.grad_bytes):>12}",
            f"  predicted peak          {format_bytes(self.predicted_peak):>12}"
            + ("" if self.budget is None else f"  (budget {format_bytes(self.budget)})"),
            *(
                [
                    f"  with .grad allocated    {format_bytes(self.accumulating_peak):>12}  (gradients added in as made:"
                    " gradient accumulation, zero_grad(set_to_none=False))"
                ]
                if self.accumulating_peak and self.accumulating_peak != self.predicted_peak
                else []
            ),
            f"  fastest plan's peak     {format_bytes(self.fastest_peak):>12}",
            *(
                [
                    f"  reserved outside graph  {format_bytes(self.reserved_bytes):>12}  (FSDP2's buffers, Options.reserve)"
                ]
                if self.reserved_bytes
                else []
            ),
            *(f"  chunked loss            {line}" for line in self.chunked),
            f"  largest tensor          {format_bytes(self.largest[2]):>12}  ({self.largest[0]} in {self.largest[1] or '<top>'})",
            "Weights, optimizer state, the gradients returned and what the loss needs (a language model's logits)"
            " exist whatever the plan; remat only trades saved activations for recompute time.",
        ]
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The plan as plain JSON data (schema ``fxremat.plan/1``, see docs/PLAN_SCHEMA.md).

        Returns:
            A dict of lists, strings and numbers; the programs' source, the node
            list and the solver's problem are left out (``save`` writes the
            first two to files).

        Example:
            >>> json.dumps(plan.to_json())  # what plan.json holds
        """
        data = dataclasses.asdict(self)
        data.pop("forward_code")
        data.pop("backward_code")
        data.pop("nodes")
        data.pop("problem")
        data["timeline"] = [list(step) for step in self.timeline]
        data["fingerprint"] = self.fingerprint()
        return {"schema": PLAN_SCHEMA, **data}

    def save(self, directory: str | os.PathLike, *, measured=None, full: bool = False) -> list[Path]:
        """Write the plan and its figures into ``directory``.

        Files: ``plan.txt`` (the report), ``plan.json`` (schema in docs/PLAN_SCHEMA.md),
        ``forward.py`` and ``backward.py`` (the final programs), ``graph.dot`` (the
        joint graph, kept and recomputed nodes coloured, collapsed per module above
        300 nodes unless ``full``), ``graph.svg`` when Graphviz's ``dot`` is installed,
        and ``timeline.png`` (predicted live memory of this plan, of ``save_all`` and of
        ``save_inputs``, the budget as a line, and ``measured`` overlaid when given).

        Args:
            directory: created if missing.
            measured: a ``fxremat.measure`` result to overlay on the timeline.
            full: draw every node of the graph even when it is large.

        Returns:
            The files written.

        Example:
            >>> fxremat.plans()[-1].save("plan/")
        """
        from . import viz

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "plan.txt", out / "plan.json", out / "forward.py", out / "backward.py"]
        written[0].write_text(str(self) + "\n")
        written[1].write_text(json.dumps(self.to_json(), indent=1) + "\n")
        written[2].write_text(self.forward_code)
        written[3].write_text(self.backward_code)
        return written + viz.save_figures(self, out, measured=measured, references=self.references, full=full)


PLAN_SCHEMA = "fxremat.plan/1"


def fingerprint(kept_names) -> str:
    """A short hash of a plan's kept value names, in graph order (``Plan.fingerprint``)."""
    return hashlib.sha256("\n".join(kept_names).encode()).hexdigest()[:16]
