"""The torch.compile backend: registration, and the one compile pipeline.

``torch.compile(model, backend="fxremat", options={...})`` finds
``fxremat_backend`` through the ``torch_dynamo_backends`` entry point, so no
import of fxremat is needed. ``fxremat.backend(budget=...)`` returns the same
backend with options bound, for code that prefers a callable.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx

from ._torch_compat import (
    MARK_DYNAMIC,
    MAYBE_MARK_DYNAMIC,
    RECOMPILE_LIMIT,
    SUPPORTED_TORCH,
    BoxedCodeGen,
    CustomPartitionerFn,
    aot_autograd,
    check_cpu_isa_ahead,
    compile_fx,
    cpu_isa_checked,
    copy_dynamo_graph,
    frame_compiles,
    fusing_at_hints,
    keyed_by_program,
    marked_dynamic,
    min_cut_partition,
    no_autograd_cache,
    returning_inputs_as_given,
    torch_version_ok,
)
from .budget import BudgetError, format_bytes
from .chunking import compile_choosing_chunks
from .grads import handing_over
from . import graph_breaks
from .options import Options
from .passes.chunk_loss import ChunkNote, noting
from .plan_cache import source_digest
from .compile_scope import Vetoed, remembering
from .conv_layout import channels_last_pays
from .passes.sizes import CAPPED, bound_sizes, cappable, fix_sizes, symbolic_sizes
from .planner import partition, watch
from .steps import TrackedGraph, track
from .verify import input_names, verified

__all__ = ["backend", "fxremat_backend", "FxrematPartitioner", "build_compiler", "eager_compiler"]

log = logging.getLogger("fxremat")
# ``torch.compile(model, backend="fxremat")`` loads this module before Dynamo traces the model.
graph_breaks.install()


class FxrematPartitioner(CustomPartitionerFn):
    """fxremat's partitioner in Inductor's ``custom_partitioner_fn`` slot.

    ``uuid()`` covers every option that changes the plan and fxremat's source,
    so Inductor's FX graph cache never serves a plan made for other options
    (``on_infeasible`` decides whether a budget is refused, never which plan runs).
    """

    def __init__(self, options: Options, sync_ranks: bool = False) -> None:
        self.options = options
        self.sync_ranks = sync_ranks

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs: Any):
        return _partition_guarded(gm, joint_inputs, self.options, sync_ranks=self.sync_ranks, **kwargs)

    def uuid(self) -> str:
        # Not on_infeasible: a plan made under "error" fits, so "min" would make the same one. Planning
        # again after a refusal (compile_scope.remembering) must find the same compiler settings.
        planned = dataclasses.replace(self.options, on_infeasible="error")
        return hashlib.sha256((planned.key() + source_digest()).encode()).hexdigest()


def _partition_guarded(gm, joint_inputs, options: Options, sync_ranks: bool = False, **kwargs):
    """Run the planner; on an unexpected failure raise with context, or fall back."""
    try:
        return partition(gm, joint_inputs, options=options, sync_ranks=sync_ranks, **kwargs)
    except (BudgetError, Vetoed):
        raise
    except Exception as exc:
        if options.on_error != "fallback":
            raise RuntimeError(
                f"fxremat failed while planning a graph of {len(gm.graph.nodes)} nodes: {type(exc).__name__}: {exc}. "
                "Pass options={'on_error': 'fallback'} to use PyTorch's partitioner for such graphs instead."
            ) from exc
        warnings.warn(
            f"fxremat failed while planning a graph ({type(exc).__name__}: {exc}); "
            "using PyTorch's min-cut partitioner for this graph (on_error='fallback')",
            stacklevel=2,
        )
        kwargs.pop("compiler", None)
        return min_cut_partition(gm, joint_inputs, **kwargs)


def eager_compiler(gm: fx.GraphModule, example_inputs, **_kwargs) -> Callable:
    """Run an fx graph as Python code in the boxed convention (inputs die at last use)."""
    gm.graph.set_codegen(BoxedCodeGen())
    gm.recompile()

    def run(args):
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _keyed_by_program(compile_program: Callable) -> Callable:
    """``compile_program`` with Inductor's FX graph cache keyed on the program and its settings, not
    on the partitioner that made it: a program a later plan of the graph leaves unchanged (the
    forward after the first step shows the logits dropped) is then served from the cache, not
    generated again. The partitioner has run by then; what it decided is the program itself.
    A forward returns the inputs it saves as given (``returning_inputs_as_given``), as the planner's
    dry lowering assumed."""

    def compile_keyed(gm: fx.GraphModule, example_inputs, **kwargs):
        if not kwargs.get("is_backward"):
            returning_inputs_as_given(gm)
        cpu_isa_checked()  # started when planning started (compile_inductor)
        with keyed_by_program():
            return compile_program(gm, example_inputs, **kwargs)

    return compile_keyed


def build_compiler(options: Options, program_compiler: Callable | None = None) -> Callable[..., TrackedGraph]:
    """The one compile pipeline, for ``torch.compile`` and ``fxremat.explain`` alike.

    Dynamo's graph -> AOTAutograd (joint graph) -> fxremat's planner -> the inner
    compiler: Inductor (its joint passes, then its code generation) or eager fx code;
    the result is watched as it runs (``steps.track``: the budget the running step
    leaves a graph, and the outputs the caller drops before backward).

    Args:
        options: validated options.
        program_compiler: compiles each planned forward and backward program in
            place of the inner compiler's own code generation (``explain``'s dry
            runs); None for the real one.

    Returns:
        A Dynamo backend ``(gm, example_inputs) -> callable``.
    """

    # explain's dry runs plan on one rank alone: they neither publish nor wait for rank 0's plans.
    dry = program_compiler is not None

    def compile_graph(gm: fx.GraphModule, example_inputs) -> TrackedGraph:
        sizes = fixing_sizes(gm, example_inputs) if options.budget is not None else None
        # A budget a plan capped at these sizes cannot meet may still be met at these sizes alone:
        # Inductor's program for symbolic sizes can hold more at once (its schedule differs).
        fixed = copy_dynamo_graph(gm) if sizes == CAPPED and options.on_infeasible == "error" else None
        try:
            # The first plans of a graph (budget refused, then the outputs dropped or the least plan;
            # the loss whole, then chunked) share what they found (compile_scope.remembering).
            with remembering():
                return track(gm, example_inputs, options, compile_planned, caller_room=not dry)
        except BudgetError as exc:
            if fixed is None:
                raise
            log.info(
                "fxremat: no plan for sizes up to these fits the budget (least %s): planning these sizes alone, "
                "each new size compiles on its own",
                format_bytes(exc.least_peak),
            )
        fix_sizes(fixed, "example_value")
        with remembering():
            return track(fixed, example_inputs, options, compile_planned, caller_room=not dry)

    def compile_planned(gm: fx.GraphModule, example_inputs, options: Options):
        """(the compiled graph, the plan made for it, or None when there was nothing to plan)."""
        return compile_choosing_chunks(gm, example_inputs, options, compile_watched)

    def compile_watched(gm: fx.GraphModule, example_inputs, options: Options, notes: tuple[ChunkNote, ...]):
        with watch() as planned, noting(notes):
            compiled = compile_inner(gm, example_inputs, options)
        return compiled, (planned[-1][2] if planned else None)

    def compile_inner(gm: fx.GraphModule, example_inputs, options: Options):
        if options.inner == "eager":
            return aot_autograd(
                fw_compiler=program_compiler or eager_compiler,
                bw_compiler=handing_over(program_compiler or eager_compiler),
                partition_fn=functools.partial(_partition_guarded, options=options, sync_ranks=dry is False),
                keep_inference_input_mutations=True,
            )(gm, example_inputs)
        # Channels-last convolutions (Inductor's layout optimisation) where the activations outweigh
        # the weights (conv_layout.py); the forward then returns the inputs it saves as given, not
        # channels-last copies of them (``_keyed_by_program``). Under a budget, only where the budget
        # is within their reach: their copies of the batch and the weights can raise the least
        # reachable peak, so a budget they do not meet is planned again in the graph's layout.
        channels_last = channels_last_pays(gm)
        if channels_last and options.budget is not None:
            return compile_within_reach(gm, example_inputs, options)
        return compile_inductor(gm, example_inputs, options, channels_last)

    def compile_within_reach(gm: fx.GraphModule, example_inputs, options: Options):
        """A budgeted graph whose convolutions pay channels-last: with them where the budget is
        within reach, else in the graph's layout where it is within reach there; out of reach both
        ways, in the layout whose least reachable peak is lower (a refusal names that one). The
        attempts refuse rather than run a least plan; the last compile reuses the plan its attempt
        made (``compile_scope.remembering``)."""
        strict = dataclasses.replace(options, on_infeasible="error")
        refused: dict[bool, BudgetError] = {}
        for layout in (True, False):
            try:
                return compile_inductor(copy_dynamo_graph(gm), example_inputs, strict, layout)
            except BudgetError as error:
                refused[layout] = error
                if layout:
                    log.info(
                        "fxremat: with channels-last convolutions the least reachable peak is %s (budget %s); "
                        "planning in the graph's layout",
                        format_bytes(error.least_peak),
                        format_bytes(error.budget),
                    )
        lower = refused[True].least_peak < refused[False].least_peak
        if options.on_infeasible == "error":
            raise refused[lower]
        return compile_inductor(gm, example_inputs, options, lower)

    def compile_inductor(gm: fx.GraphModule, example_inputs, options: Options, channels_last: bool | None):
        # Inductor's FX graph cache, keyed by the partitioner's uuid, still skips code generation.
        patches: dict[str, object] = {"custom_partitioner_fn": FxrematPartitioner(options, sync_ranks=dry is False)}
        # The planner judges each plan on the program Inductor generates under these same
        # settings (passes/inductor_memory.py), so they change memory, not the truth of a prediction.
        if channels_last is not None:
            log.info("fxremat: convolutions %s", "channels-last" if channels_last else "in the graph's layout")
        if channels_last is False:
            patches["layout_optimization"] = False
        if options.budget is not None:
            # Buffer reuse holds a dead buffer until a later allocation of its size takes it:
            # GPT-2 4x256 (the demo), least plan, measured 53.4 MiB with it and 49.2 MiB without.
            patches["allow_buffer_reuse"] = False
        if program_compiler is None and any(
            isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in example_inputs
        ):
            # Its C++ kernels need Inductor's check of the CPU, which dry lowerings skip: it runs beside planning.
            check_cpu_isa_ahead()
        inner = fusing_at_hints(handing_over(program_compiler or _keyed_by_program(compile_fx.compile_fx_inner)))
        with no_autograd_cache():
            return compile_fx.compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    return compile_graph


def fixing_sizes(gm: fx.GraphModule, example_inputs) -> str | None:
    """Under a budget, guard the sizes of a graph Dynamo traced with symbolic ones for a plan made at them.

    A budget is a promise about each step that runs, and a plan's peak grows with its
    sizes: a graph Dynamo made dynamic (a second sequence length, ``dynamic=True``) is
    planned at the sizes it came with and capped at them where every tensor grows with
    them (``passes/sizes.py``): it runs every size up to them, and a larger one compiles
    and plans again. Where a tensor could fall as a size grows the sizes are fixed: each
    new size compiles on its own. With no budget nothing is guarded: one plan, made at the
    first dynamic sizes, runs every length, as plain ``torch.compile`` runs its own.

    Dynamo compiles one frame at most its recompile limit times and runs it uncompiled
    after that, outside the plan and the budget: the last such compile warns.

    Returns:
        ``sizes.CAPPED``, ``sizes.FIXED``, or None when no size is symbolic.
    """
    if not symbolic_sizes(gm, "example_value"):
        return None
    capped = cappable(gm, "example_value")
    marked = [
        (str(node.target), sorted(marked_dynamic(v)))
        for node, v in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
        if isinstance(v, torch.Tensor) and marked_dynamic(v)
    ]
    if marked and not capped:
        where = "; ".join(f"{name}, dimensions {dims}" for name, dims in marked)
        raise ValueError(
            f"fxremat: sizes marked dynamic with {MARK_DYNAMIC} ({where}), but under a budget fxremat "
            "plans this graph for its sizes (a plan's peak changes with them, and some tensor of the graph does "
            f"not grow with them) and compiles each new size on its own. Use {MAYBE_MARK_DYNAMIC}, or drop the "
            "budget to plan once for any size"
        )
    sizes = bound_sizes(gm, "example_value", capped)
    compiles = frame_compiles()
    if compiles is not None and compiles[0] >= compiles[1]:
        which = "larger than any compiled so far" if capped else "not seen yet"
        warnings.warn(
            f"fxremat: under a budget a new input size is planned and compiled on its own, and this is "
            f"compile {compiles[0]} of this function, the most Dynamo makes ({RECOMPILE_LIMIT} "
            f"= {compiles[1]}): inputs of a size {which} will run uncompiled, outside the budget. Pad inputs "
            "to a few sizes (e.g. a tokenizer's pad_to_multiple_of), or raise the limit",
            stacklevel=2,
        )
    return sizes


def _compile_reference(gm: fx.GraphModule, example_inputs, options: Options):
    """The same graph through the same inner compiler with PyTorch's own (min-cut) partition."""
    if options.inner == "eager":
        return aot_autograd(
            fw_compiler=eager_compiler,
            bw_compiler=eager_compiler,
            partition_fn=min_cut_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    return compile_fx.compile_fx(gm, example_inputs)


def _compile(gm: fx.GraphModule, example_inputs, options: Options):
    if not torch_version_ok():
        (low, high) = SUPPORTED_TORCH
        warnings.warn(
            f"fxremat is tested with torch >={low[0]}.{low[1]},<{high[0]}.{high[1]}; this is torch {torch.__version__}",
            stacklevel=2,
        )
    compiler = build_compiler(options)
    if not options.verify:
        return compiler(gm, example_inputs)
    # The reference gets its own copy: compiling may rewrite the graph in place.
    reference_gm = copy.deepcopy(gm)
    names = input_names(gm)
    compiled = compiler(gm, example_inputs)
    # The tracked graph knows its plan (counting fxremat.plans() fails once the history is full).
    where = compiled.plan.graph if compiled.plan is not None else "a graph with no backward"
    return verified(compiled, _compile_reference(reference_gm, example_inputs, options), names, where)


def fxremat_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """The ``"fxremat"`` backend that ``torch.compile`` finds by name.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: the ``options=`` mapping of ``torch.compile`` (see ``fxremat.Options``).
        mode: ignored (``torch.compile``'s mode presets belong to Inductor).

    Returns:
        The compiled callable.

    Example:
        >>> compiled = torch.compile(model, backend="fxremat", options={"budget": "2GiB", "inner": "eager"})
    """
    return _compile(gm, example_inputs, Options.from_mapping(options))


def backend(budget: int | str | None = None, **options: Any) -> Callable:
    """A torch.compile backend that plans recomputation under ``budget``.

    Args:
        budget: peak bytes of the step's activations, temporaries and gradients:
            an int, a string with a unit (``"2GiB"``, ``"512MiB"``, ``"1.5GB"``),
            or None for no budget (the least peak within ``time_slack`` of the fastest
            plan's estimated time). ``FXREMAT_BUDGET`` is read when None
            and the variable is set.
        **options: ``inner`` ("inductor" or "eager"), ``solver``, ``hardware``,
            ``on_infeasible`` ("error" or "min"), ``on_error`` ("raise" or
            "fallback"), ``time_limit``, ``dump_dir``, ``measure_scratch``
            (see ``fxremat.Options``).

    Returns:
        A backend for ``torch.compile(model, backend=...)``.

    Example:
        >>> compiled = torch.compile(model, backend=fxremat.backend(budget="2GiB", inner="eager"))
        >>> compiled(x).sum().backward()
    """
    mapping = dict(options)
    if budget is not None:
        mapping["budget"] = budget
    opts = Options.from_mapping(mapping)

    def fxremat(gm: fx.GraphModule, example_inputs):
        return _compile(gm, example_inputs, opts)

    fxremat.options = opts  # type: ignore[attr-defined]
    return fxremat
