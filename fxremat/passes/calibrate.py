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
``MAX_CALIBRATION_BYTES``. ``NodeCost.timed`` says which nodes were timed.

What is timed is the eager aten op: under ``inner="inductor"`` fused kernels
run faster than the sum of their ops, so calibrated seconds are an upper
bound there, as the roofline is.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import statistics
import time

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from .._torch_compat import disable_current_modes, is_sym_node
from .cost import NodeCost
from .problem import never_recompute_reason
from .scratch import MAX_CALIBRATION_BYTES, _materialize, _signature

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
            key = _signature(node)
        except Exception as exc:  # an argument whose size has no hint: keep the roofline, say so
            log.debug("calibration skips %s (%s)", node.name, exc)
            continue
        first.setdefault(key, node)
        keyed.append((node, key))
    if not first:
        return dict(costs)
    if torch.autograd.profiler._is_profiler_enabled:
        # Compiling inside a profiler (fxremat.measure, a user's trace): running ops here
        # would show in that trace and its memory peak, as in passes/scratch.py.
        log.info("a profiler is active: ops not calibrated for this graph (roofline seconds kept)")
        return dict(costs)
    # Real tensors (outside AOTAutograd's fake mode), without moving the user's RNG.
    with disable_current_modes(), torch.random.fork_rng(devices=[]), torch.no_grad():
        timed = {key: s for key, node in first.items() if (s := _time(node)) is not None}
    out = dict(costs)
    for node, key in keyed:
        if key in timed:
            out[node] = dataclasses.replace(costs[node], seconds=timed[key], timed=True)
    log.info(
        "calibrated %d of %d distinct ops (%d of %d nodes) in %.2f s",
        len(timed), len(first), sum(1 for _, k in keyed if k in timed), len(costs), time.perf_counter() - t0,
    )
    return out


def _runnable(node: fx.Node) -> bool:
    """Whether ``node`` can run standalone on synthetic inputs without side effects."""
    target = node.target
    if node.op != "call_function" or target is operator.getitem or not isinstance(target, torch._ops.OpOverload):
        return False
    if is_sym_node(node):  # size arithmetic under dynamic shapes: no tensor work
        return False
    if never_recompute_reason(node) is not None:  # random, mutating, collective, effectful
        return False
    vals = [a.meta.get("val") for a in node.all_input_nodes] + _tensors(node.meta.get("val"))
    if any(v is None for v in vals):
        return False
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if not tensors or len({t.device for t in tensors if t.dim() > 0 or t.device.type != "cpu"}) > 1:
        return False
    if any(t.device.type == "meta" for t in tensors):
        return False
    return sum(_nbytes(t) for t in tensors) <= MAX_CALIBRATION_BYTES


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _hint(x):
    return int(optimization_hint(x)) if isinstance(x, torch.SymInt) else x


def _nbytes(t: torch.Tensor) -> int:
    return int(_hint(t.numel())) * t.element_size()


def _device(node: fx.Node) -> torch.device:
    tensors = _tensors(node.meta.get("val")) or [a.meta["val"] for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    return max((t.device for t in tensors), key=lambda d: d.type != "cpu")


def _call(node: fx.Node):
    """A zero-argument callable running ``node``'s op on fresh real inputs."""
    real = {}
    for a in node.all_input_nodes:
        v = a.meta["val"]
        if isinstance(v, torch.Tensor):
            real[a] = _materialize(v)
        elif isinstance(v, (list, tuple)):
            real[a] = type(v)(_materialize(t) if isinstance(t, torch.Tensor) else _hint(t) for t in v)
        else:
            real[a] = _hint(v)
    args = fx.node.map_arg(node.args, lambda a: real[a])
    kwargs = fx.node.map_arg(node.kwargs, lambda a: real[a])
    target = node.target
    assert callable(target), f"{node.format_node()}: target is not callable"  # _runnable: an OpOverload
    return lambda: target(*args, **kwargs)


def _time(node: fx.Node) -> float | None:
    """Median seconds of one run of ``node``'s op, or None when it cannot run standalone."""
    device = _device(node)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    try:
        call = _call(node)
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
