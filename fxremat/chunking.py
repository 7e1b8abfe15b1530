"""Whether to compute a graph's loss a chunk of tokens at a time (``Options.chunk_loss``), by planning.

``passes/chunk_loss.py`` finds the LM head + cross-entropy sites of Dynamo's graph and
rewrites them; this module decides, with the planner's own numbers:

- "off": never, and the graph is left as Dynamo made it; a ``BudgetError`` says when the
  logits are why the budget is out of reach.
- an int: always, in that many chunks.
- "on": always, in as many chunks as "auto" cuts. A graph "auto" chunked is planned again this
  way (``steps.TrackedGraph``): once the first step shows more room (the logits dropped, ``.grad``
  allocated), planning the loss whole again to compare would cost a second plan and compile for a
  choice the first plan made with less room.
- "auto": with no budget, never (chunking adds the head's matmul again in the backward and
  saves memory nobody asked for). Under a budget the unchunked graph is planned first; the
  chunked one is planned too when no unchunked plan fits, or when the unchunked plan fits only by
  recomputing more (estimated) time than the chunked head adds and the logits are a real share
  of the budget. The plan that fits, then the faster (recompute plus the head's extra matmul), runs;
  the other is dropped from ``fxremat.plans()``. The whole graph's plan is judged before any code
  is generated for it (``compile_scope.vetoing``): when the chunked one is planned, only the one that
  runs is compiled, and the whole plan, when it wins, is not searched again (``compile_scope.remembering``).

Unless "off", logits the model returns leave the graph without a gradient path through it, chunked
or not (``chunk_loss.chunk_losses``): the backward takes no logits-sized gradient of zeros for them.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch.fx as fx

from ._torch_compat import copy_dynamo_graph
from .budget import BudgetError, format_bytes
from .hardware import get_hardware
from .options import Options
from .passes.chunk_loss import (
    HEAD_GRADS,
    ChunkNote,
    LossSite,
    chunk_count,
    chunk_losses,
    find_loss_sites,
    note_for,
    reattach_head_grads,
)
from .plan import Plan
from .compile_scope import vetoing

__all__ = ["compile_choosing_chunks", "LOGITS_MIN_SHARE"]

log = logging.getLogger("fxremat")

# "auto" plans a chunked candidate beside a plan that fits only when one fp32 copy of the logits is
# at least this share of the budget: below it, chunking moves too little memory to pay for a second
# plan (and compile). The same share decides whether a BudgetError names the logits.
LOGITS_MIN_SHARE = 0.05

# (gm, example_inputs, options, chunk notes for the plan) -> (compiled, plan or None)
CompileOne = Callable[[fx.GraphModule, list, Options, tuple[ChunkNote, ...]], tuple[Callable, "Plan | None"]]


def compile_choosing_chunks(
    gm: fx.GraphModule, example_inputs: list, options: Options, compile_one: CompileOne
) -> tuple[Callable, Plan | None]:
    """Compile ``gm``, its losses chunked or not as ``options.chunk_loss`` and the plans decide.

    Args:
        gm: Dynamo's graph (rewritten in place when chunked).
        example_inputs: its example inputs.
        options: the options it is planned under.
        compile_one: compiles one version of the graph and returns its plan.

    Returns:
        (the compiled graph, its plan).

    Raises:
        BudgetError: no plan fits, chunked or not (``on_infeasible="error"``).
    """
    sites = find_loss_sites(gm)
    if not sites:
        return compile_one(gm, example_inputs, options, ())
    if options.chunk_loss == "off":
        try:
            return compile_one(gm, example_inputs, options, ())
        except BudgetError as exc:
            raise _naming_logits(exc, sites) from None
    if isinstance(options.chunk_loss, int):
        return _compile_sites(gm, example_inputs, options, sites, compile_one, options.chunk_loss, None)
    if options.chunk_loss == "on":
        return _compile_chunked(gm, example_inputs, options, sites, compile_one, None)
    counts = [chunk_count(site) for site in sites]
    if options.budget is None or max(counts) < 2:
        return _compile_sites(gm, example_inputs, options, sites, compile_one, 1, None)
    source = copy_dynamo_graph(gm)
    extra = _extra_seconds(sites, options)
    logits = max(site.logits_bytes() for site in sites)
    budget = options.budget

    def chunk_instead(plan: Plan) -> bool:
        # Fits whole only by recomputing more than chunking adds, with logits worth chunking: the
        # whole graph is not compiled (compile_scope.vetoing) until the chunked one is planned.
        return not (plan.feasible and (plan.recompute_seconds <= extra or logits < LOGITS_MIN_SHARE * budget))

    try:
        with vetoing(chunk_instead) as whole:
            return _compile_sites(gm, example_inputs, options, sites, compile_one, 1, None)
    except BudgetError as exc:
        log.info("fxremat: no plan fits with the loss whole (least %s): chunking it", format_bytes(exc.least_peak))
        try:
            return _compile_chunked(source, example_inputs, options, sites, compile_one, exc.least_peak)
        except BudgetError as chunked_exc:
            # The least of the two: chunking can also raise the least peak (its own search on a larger graph).
            if chunked_exc.least_peak <= exc.least_peak:
                why = f"That is with the loss chunked ({_sites(sites)}); without chunking the least is "
                why += f"{format_bytes(exc.least_peak)}."
            else:
                why = f"That is with the loss whole; chunked ({_sites(sites)}) the least is "
                why += f"{format_bytes(chunked_exc.least_peak)}."
            least = min(chunked_exc.least_peak, exc.least_peak)
            raise BudgetError(chunked_exc.budget, least, where=chunked_exc.where, why=why).explained(exc.why) from None
    # Set aside: the whole loss fits only by recomputing more than chunking adds.
    assert whole.plan is not None
    whole_plan = whole.plan

    def worse(chunked_plan: Plan) -> bool:
        return not _better(chunked_plan, extra, whole_plan)

    try:
        # Compiled only when it beats the whole plan: else set aside before code generation too.
        with vetoing(worse):
            return _compile_chunked(
                copy_dynamo_graph(source), example_inputs, options, sites, compile_one, whole_plan.predicted_peak
            )
    except BudgetError:
        pass  # chunking raised the least peak above a budget the whole loss fits
    # The loss whole after all: its plan is remembered (compile_scope.remembering), not searched again.
    return _compile_sites(source, example_inputs, options, sites, compile_one, 1, None)


def _better(chunked: Plan, extra: float, whole: Plan) -> bool:
    """The chunked plan runs when it fits and the whole one does not, or both fit and it is faster."""
    if chunked.feasible != whole.feasible:
        return chunked.feasible
    if not whole.feasible:
        return chunked.predicted_peak < whole.predicted_peak
    return chunked.recompute_seconds + extra < whole.recompute_seconds


def _compile_chunked(
    gm: fx.GraphModule,
    example_inputs: list,
    options: Options,
    sites: list[LossSite],
    compile_one: CompileOne,
    unchunked_peak: int | None,
) -> tuple[Callable, Plan | None]:
    """Compile ``gm`` with its losses in as many chunks as the budget asks (``chunk_count``); when
    that plan does not fit, in the most chunks "auto" cuts.

    The plan at the budget's count that does not fit is set aside before code generation
    (``on_infeasible="min"``) or refused (``BudgetError``); the most chunks then get their own
    plan, which runs or raises.
    """
    budget = _budget(options)
    if all(chunk_count(site, None, budget) == chunk_count(site) for site in sites):
        return _compile_sites(gm, example_inputs, options, sites, compile_one, None, unchunked_peak)
    source = copy_dynamo_graph(gm)
    try:
        with vetoing(lambda plan: not plan.feasible):
            return _compile_sites(gm, example_inputs, options, sites, compile_one, None, unchunked_peak, budget)
    except BudgetError:
        pass
    log.info("fxremat: no plan fits with %s: cutting it finer, %s", _sites(sites, budget), _sites(sites))
    return _compile_sites(source, example_inputs, options, sites, compile_one, None, unchunked_peak)


def _budget(options: Options) -> int | None:
    """The bytes the chunk count is chosen for: the graph's budget, less what is reserved outside it."""
    return None if options.budget is None else max(1, options.budget - options.reserve)


def _compile_sites(
    gm: fx.GraphModule,
    example_inputs: list,
    options: Options,
    sites: list[LossSite],
    compile_one: CompileOne,
    chunks: int | None,
    unchunked_peak: int | None,
    budget: int | None = None,
) -> tuple[Callable, Plan | None]:
    """Compile ``gm`` with its losses in ``chunks`` (1: whole; None: ``chunk_count`` under ``budget``, the most
    "auto" cuts without one), returned logits leaving the graph without a gradient path either way
    (``chunk_losses``)."""
    counts = {site.loss.name: chunk_count(site, chunks, budget) for site in sites}
    # The sites of this graph (a copy of the one they were found in): matched by node name.
    mine = find_loss_sites(gm)
    notes = tuple(note_for(site, counts[site.loss.name], unchunked_peak) for site in mine if counts[site.loss.name] > 1)
    chunk_losses(gm, {site.loss: counts[site.loss.name] for site in mine})
    compiled, plan = compile_one(gm, example_inputs, options, notes)
    heads = gm.meta.get(HEAD_GRADS)
    return (reattach_head_grads(compiled, heads) if heads else compiled), plan


def _extra_seconds(sites: list[LossSite], options: Options) -> float:
    """Estimated time chunking adds: each head's matmul once more, in the backward."""
    flops = sum(note_for(site, chunk_count(site)).extra_flops for site in sites)
    return flops / get_hardware(options.hardware).peak_flops


def _sites(sites: list[LossSite], budget: int | None = None) -> str:
    notes = (note_for(site, chunk_count(site, None, budget)) for site in sites)
    return ", ".join(f"{note.site} in {note.chunks} chunks" for note in notes)


def _naming_logits(exc: BudgetError, sites: list[LossSite]) -> BudgetError:
    """The same error, naming the logits when they are a real share of the least peak."""
    site = max(sites, key=lambda s: s.logits_bytes())
    if site.logits_bytes() < LOGITS_MIN_SHARE * exc.least_peak:
        return exc
    where = note_for(site, 1).site
    why = (
        f"The loss sets part of that floor: {where} makes vocabulary-sized tensors ({site.tokens} tokens x "
        f"{site.vocab} classes, {format_bytes(site.logits_bytes())} each in fp32: the logits, their log-softmax, "
        "their gradient) that no plan can recompute away. chunk_loss='auto' (the default) or a number of chunks "
        "computes the loss a chunk of tokens at a time."
    )
    return BudgetError(exc.budget, exc.least_peak, where=exc.where, why=why)
