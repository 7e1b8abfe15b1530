"""Calibration: replace the roofline's seconds by each op's time on the real device.

With ``calibrate=True`` every distinct (op, argument shapes, strides, dtypes,
constants) of the joint graph runs standalone on real tensors of the graph's
device (random data of the right shape and dtype), a few timed reps, and the
median becomes the ``seconds`` of every node with that signature. Nodes that
cannot run standalone keep their roofline estimate: random ops (they would
draw from the generator; attention with ``dropout_p=0`` draws nothing and is
timed), ops that mutate an argument, collectives and other effectful ops (as
``problem.never_recompute_reason`` lists them), getitems, higher-order ops,
graphs on the meta device, and ops whose tensors exceed
``oprun.MAX_STANDALONE_BYTES``. ``NodeCost.timed`` says which nodes were timed.

What is timed is the eager aten op: under ``inner="inductor"`` fused kernels
run faster than the sum of their ops, so calibrated seconds are an upper
bound there, as the roofline is.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import torch
import torch.fx as fx

from .._torch_compat import is_sym_node, profiler_is_enabled
from .cost import NodeCost
from .opinfo import is_op_call, nbytes_hint, tensors_of
from .oprun import MAX_STANDALONE_BYTES, op_signature, real_tensors, standalone_call
from .problem import never_recompute_reason

__all__ = ["calibrate_costs", "CALIBRATION_REPS"]

log = logging.getLogger(__name__)

# Timed samples per distinct op; the median of 5 survives a sample or two lost
# to descheduling on a shared host (docs/COST_MODEL.md shows 8 ms stalls).
CALIBRATION_REPS = 5
# One sample repeats a fast op until it lasts about this long (100 us), so
# perf_counter's resolution and the timer's own cost (~0.1 us) stay below 1%.
_MIN_SAMPLE_SECONDS = 1e-4
# ... but never more than this many calls per sample (tiny ops take ~3 us).
_MAX_CALLS_PER_SAMPLE = 64
# An op whose warm-up run took longer than this (50 ms) is timed once more,
# not CALIBRATION_REPS times: noise is small against it and planning stays short.
_SLOW_OP_SECONDS = 0.05


def calibrate_costs(gm: fx.GraphModule, costs: dict[fx.Node, NodeCost]) -> dict[fx.Node, NodeCost]:
    """Time each distinct op of ``gm`` on its device and use those times as seconds.

    Args:
        gm: the joint graph whose nodes carry FakeTensor ``meta["val"]``.
        costs: the roofline cost table from ``cost.annotate(gm, hardware)``.

    Returns:
        A new cost table: timed nodes carry the measured median seconds and
        ``timed=True``; the others keep their roofline record unchanged.

    Example:
        >>> costs = calibrate_costs(joint, annotate(joint, get_hardware("cpu")))  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    first: dict[tuple, fx.Node] = {}
    keyed: list[tuple[fx.Node, tuple]] = []
    for node in gm.graph.nodes:
        if not _runnable(node):
            continue
        try:
            key = op_signature(node)
        except Exception as exc:  # an argument whose size has no hint: keep the roofline, say so
            log.debug("calibration skips %s (%s)", node.name, exc)
            continue
        first.setdefault(key, node)
        keyed.append((node, key))
    if not first:
        return dict(costs)
    if profiler_is_enabled():
        # Compiling inside a profiler (fxremat.measure, a user's trace): running ops here
        # would show in that trace and its memory peak, as in passes/scratch.py.
        log.info("a profiler is active: ops not calibrated for this graph (roofline seconds kept)")
        return dict(costs)
    # Real tensors (outside AOTAutograd's fake mode), without moving the user's RNG.
    with real_tensors():
        timed = {key: s for key, node in first.items() if (s := _time(node)) is not None}
    out = dict(costs)
    for node, key in keyed:
        if key in timed:
            out[node] = dataclasses.replace(costs[node], seconds=timed[key], timed=True)
    log.info(
        "calibrated %d of %d distinct ops (%d of %d nodes) in %.2f s",
        len(timed),
        len(first),
        sum(1 for _, k in keyed if k in timed),
        len(costs),
        time.perf_counter() - t0,
    )
    return out


def _runnable(node: fx.Node) -> bool:
    """Whether ``node`` can run standalone on synthetic inputs without side effects."""
    if not is_op_call(node):
        return False
    if is_sym_node(node):  # size arithmetic under dynamic shapes: no tensor work
        return False
    if never_recompute_reason(node) is not None:  # random, mutating, collective, effectful
        return False
    vals = [a.meta.get("val") for a in node.all_input_nodes] + tensors_of(node.meta.get("val"))
    if any(v is None for v in vals):
        return False
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if not tensors or len({t.device for t in tensors if t.dim() > 0 or t.device.type != "cpu"}) > 1:
        return False
    if any(t.device.type == "meta" for t in tensors):
        return False
    return nbytes_hint(tensors) <= MAX_STANDALONE_BYTES


def _device(node: fx.Node) -> torch.device:
    tensors = tensors_of(node.meta.get("val"))
    tensors = tensors or [a.meta["val"] for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    return max((t.device for t in tensors), key=lambda d: d.type != "cpu")


def _time(node: fx.Node) -> float | None:
    """Median seconds of one run of ``node``'s op, or None when it cannot run standalone."""
    device = _device(node)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    try:
        call = standalone_call(node)
        sync()
        call()  # warm-up: first-call dispatch, kernel selection, allocator growth
        sync()
        t = time.perf_counter()
        call()
        sync()
        warm = time.perf_counter() - t
        calls = max(1, min(_MAX_CALLS_PER_SAMPLE, int(_MIN_SAMPLE_SECONDS / max(warm, 1e-9))))
        reps = 1 if warm > _SLOW_OP_SECONDS else CALIBRATION_REPS
        samples = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            for _ in range(calls):
                call()
            sync()
            samples.append((time.perf_counter() - t) / calls)
        return statistics.median(samples)
    except Exception as exc:  # an op that rejects synthetic inputs: keep its roofline, say so
        log.debug("calibration could not time %s (%s: %s)", node.target, type(exc).__name__, exc)
        return None
