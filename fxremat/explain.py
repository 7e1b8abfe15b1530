"""Plan without training: ``explain`` and ``pareto``.

``explain`` runs the same pipeline ``torch.compile(backend="fxremat")`` runs
(Dynamo, AOTAutograd, Inductor's joint passes when ``inner="inductor"``, the
fxremat planner: ``backend.build_compiler``, the one pipeline both use) on the
model and example inputs, but replaces the
compiled forward and backward with dry runs: they return tensors of the right
shapes and dtypes whose saved values and gradients take no memory (zero-stride
views of one element), and compute nothing. So no training step runs, no
activation is allocated, and the plan is the one ``torch.compile`` would make
for the same graph and options. Only the forward's user-visible outputs are
allocated (filled with zeros) so Python code between graphs can go on.

A model too large to build can be planned without its weights: build it on the
meta device (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)``),
with inputs on meta too, and call ``explain`` as usual. ``explain`` plans a copy
whose meta parameters, buffers and inputs are fake CPU tensors (PyTorch's fake
tensors take no memory): Dynamo rejects a real meta tensor that meets a fake one
(HF's cache starts from an empty meta tensor). A model built under a
``FakeTensorMode()`` plans the same way.
"""

from __future__ import annotations

import copy
import itertools
import logging
import types
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from ._torch_compat import FakeTensor, FakeTensorMode, tree_leaves, tree_map
from .backend import build_compiler
from .options import Options
from .plan import Plan
from .planner import USER_OUTPUTS, watch
from .solvers.registry import solve
from .solvers.types import Decision, SolveOptions

__all__ = ["explain", "pareto", "ParetoPoint"]

log = logging.getLogger(__name__)


def _empty_like_meta(val, materialize: bool):
    """A tensor shaped like ``val``: zeros if ``materialize``, else a zero-stride view (no memory)."""
    if not isinstance(val, torch.Tensor):
        return val
    shape = [int(s) for s in val.shape]
    if materialize:
        return torch.zeros(shape, dtype=val.dtype, device=val.device)
    return torch.zeros((), dtype=val.dtype, device=val.device).expand(shape)


def _dry_compiler(gm: fx.GraphModule, example_inputs, **_kwargs):
    """A program compiler whose programs compute nothing and allocate only user outputs."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in output.args[0]]
    backward = any("tangents" in str(n.target) for n in gm.graph.find_nodes(op="placeholder"))
    # The forward returns the user outputs, then the saved values (the planner marks how many).
    users = 0 if backward else gm.meta.get(USER_OUTPUTS, len(vals))

    def run(args):
        args.clear()
        return [_empty_like_meta(v, materialize=i < users) for i, v in enumerate(vals)]

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


# Numbers explain's entry code objects (``_fresh_entry``).
_ENTRIES = itertools.count()


def _fresh_entry():
    """A new function object with its own code object, to hand ``torch.compile``.

    Dynamo caches compiled code on the code object of the frame it compiles. Compiling a
    function whose code object no one else has keeps explain's dry programs out of the
    caches of the user's compiled model (same class, same ``forward``), so explain needs
    no reset of Dynamo's caches, and the user's compiled functions stay compiled.

    Each code object is also unequal to every earlier one (its own name): Dynamo keeps
    what it saw of a frame's input sizes keyed by code objects, which compare by value, so
    equal copies would share that record, and a model explained after another with other
    input sizes was traced with dynamic sizes (``automatic_dynamic_shapes``): a different
    graph, and a plan that depended on what was explained before in the process.
    """

    def call(model_or_fn, args):
        return model_or_fn(*args)

    name = f"fxremat_explain_{next(_ENTRIES)}"
    code = call.__code__.replace(co_name=name)  # code objects compare by co_name, among other fields
    return types.FunctionType(code, call.__globals__, name)


def _tensors(model_or_fn, args) -> list[torch.Tensor]:
    tensors = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
    if isinstance(model_or_fn, torch.nn.Module):
        tensors += list(model_or_fn.parameters())
    return tensors


def _has_fake(model_or_fn, args) -> bool:
    return any(isinstance(t, FakeTensor) for t in _tensors(model_or_fn, args))


def _has_meta(model_or_fn, args) -> bool:
    tensors = _tensors(model_or_fn, args)
    if isinstance(model_or_fn, torch.nn.Module):
        tensors += list(model_or_fn.buffers())
    return any(t.is_meta and not isinstance(t, FakeTensor) for t in tensors)


def _from_meta(model_or_fn, args):
    """A copy of a meta-device model, and the inputs, with every meta tensor a fake CPU tensor.

    Copying a meta model costs no memory; tied parameters stay tied (one fake per
    parameter object). Values do not exist either way: the plan needs shapes only.
    """
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            with mode:
                out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                if isinstance(t, torch.nn.Parameter):
                    out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
                elif t.requires_grad:
                    out.requires_grad_(True)
            made[id(t)] = out
        return made[id(t)]

    if isinstance(model_or_fn, torch.nn.Module):
        model_or_fn = copy.deepcopy(model_or_fn)
        for module in model_or_fn.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is not None and t.is_meta and not isinstance(t, FakeTensor):
                        table[name] = fake(t)
    args = tree_map(lambda a: fake(a) if isinstance(a, torch.Tensor) and a.is_meta else a, args)
    return model_or_fn, args


def _largest(found: list[Plan]) -> Plan:
    if not found:
        raise RuntimeError(
            "fxremat.explain found no graph to plan: the model ran without a backward graph "
            "(no input or parameter requires grad, or it ran under torch.no_grad())."
        )
    if len(found) > 1:
        warnings.warn(
            f"the model compiled into {len(found)} graphs (graph breaks); each is planned under the whole "
            f"budget. Returning the plan with the largest predicted peak; all are in fxremat.plans().",
            stacklevel=3,
        )
    return max(found, key=lambda p: p.predicted_peak)


def explain(model_or_fn, *args, budget=None, **options) -> Plan:
    """Plan a model's training step without running it.

    Args:
        model_or_fn: an ``nn.Module`` or function whose output is a tensor (a loss,
            or anything ``.sum()`` turns into one).
        *args: example inputs.
        budget: as for ``fxremat.backend``: bytes, a string with a unit, or None.
        **options: the other ``fxremat.backend`` options (``solver``, ``inner``, ...).

    Returns:
        The Plan (the one with the largest predicted peak when the model has graph breaks).

    Raises:
        BudgetError: the budget is below the least reachable peak (unless on_infeasible="min").

    Example:
        >>> plan = fxremat.explain(model, x, budget="2GiB")
        >>> print(plan)
        >>> plan.save("plan/")
    """
    mapping = dict(options)
    if budget is not None:
        mapping["budget"] = budget
    if _has_meta(model_or_fn, args):
        model_or_fn, args = _from_meta(model_or_fn, args)
    return _largest(_plan(model_or_fn, args, _options(model_or_fn, args, mapping)))


def _options(model_or_fn, args, mapping: dict) -> Options:
    if _has_fake(model_or_fn, args):
        # Fake weights stand for a model too large to build: never run its ops for real.
        mapping = {"measure_scratch": False, **mapping}
    return Options.from_mapping(mapping)


def _plan(model_or_fn, args, options: Options) -> list[Plan]:
    """Run Dynamo, AOTAutograd and the planner on a dry step; return the plans made."""
    params = list(model_or_fn.parameters()) if isinstance(model_or_fn, torch.nn.Module) else []
    saved_grads = [p.grad for p in params]
    try:
        with watch() as planned:
            compiled = torch.compile(_fresh_entry(), backend=build_compiler(options, _dry_compiler))
            out = compiled(model_or_fn, args)
            loss = out if isinstance(out, torch.Tensor) else _first_tensor(out)
            if loss.requires_grad:
                root = loss if loss.dim() == 0 else loss.sum()
                leaves = [t for t in _tensors(model_or_fn, args) if t.requires_grad and t.is_leaf]
                if leaves:
                    # Not .backward(): the dry backward returns each gradient as a zero-stride view, which
                    # .grad would copy into real memory of its parameter's size (a 70B model on meta: 140 GB).
                    torch.autograd.grad(root, leaves, allow_unused=True)
                else:
                    root.backward()
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    return [plan for _, _, plan in planned]


def _first_tensor(out):
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf
    raise TypeError(f"the model returned {type(out).__name__} with no tensor that requires grad; return the loss")


@dataclass(frozen=True)
class ParetoPoint:
    """One point of the memory/time front of a graph.

    Attributes:
        budget: the budget the point was solved for (bytes).
        predicted_peak: the plan's predicted peak (bytes).
        recompute_seconds: estimated time of its recomputation.
        solver: which solver chose it.
        plan: the solver's decision (kept and recomputed node ids of the graph).
    """

    budget: int
    predicted_peak: int
    recompute_seconds: float
    solver: str
    plan: Decision


def pareto(model_or_fn, *args, points: int = 8, **options) -> list[ParetoPoint]:
    """The front of (predicted peak, estimated recompute time) across budgets.

    Plans the model once (as ``explain``), then solves its largest graph for
    ``points`` budgets from the fastest plan's peak down to the least reachable
    peak, keeping the points no other point dominates.

    Args:
        model_or_fn, *args: as for ``explain``.
        points: how many budgets to try.
        **options: ``solver``, ``inner``, ``hardware``, ``time_limit``.

    Returns:
        Points sorted by decreasing predicted peak.

    Example:
        >>> for p in fxremat.pareto(model, x, points=6):
        ...     print(p.predicted_peak, p.recompute_seconds)
    """
    if points < 2:
        raise ValueError(f"points={points} must be at least 2")
    options.pop("budget", None)
    if _has_meta(model_or_fn, args):
        model_or_fn, args = _from_meta(model_or_fn, args)
    opts = _options(model_or_fn, args, options)
    base = _largest(_plan(model_or_fn, args, opts))
    problem = base.problem
    if problem is None:
        raise RuntimeError(
            f"{base.graph}: the plan carries no RematProblem to re-solve; this is a bug in fxremat, please report it"
        )
    solver = opts.solver
    solve_options = SolveOptions(time_limit=opts.time_limit)
    fastest = solve(problem, None, solver, solve_options)
    least = solve(problem, 1, solver, solve_options)
    hi, lo = fastest.peak_bytes, least.peak_bytes
    found: list[ParetoPoint] = []
    for k in range(points):
        budget = hi - (hi - lo) * k // (points - 1)
        d = solve(problem, budget, solver, solve_options)
        if d.feasible:
            found.append(ParetoPoint(budget, d.peak_bytes, d.recompute_seconds, d.solver, d))
    front: list[ParetoPoint] = []
    for p in sorted(found, key=lambda p: (p.predicted_peak, p.recompute_seconds)):
        if not front or p.recompute_seconds < front[-1].recompute_seconds:
            front.append(p)
    return sorted(front, key=lambda p: -p.predicted_peak)
