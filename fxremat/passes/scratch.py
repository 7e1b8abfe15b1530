"""Scratch pass: bytes an op allocates inside itself beyond its outputs.

Some kernels allocate workspace that never appears in the graph: CPU
convolution's im2col columns, dropout's float noise before the mask, cuBLAS
and cuDNN workspaces. The liveness simulation adds each node's scratch to the
live bytes while the node runs, so predicted peaks match measured ones.

Scratch is measured, not guessed: each distinct (op, argument shapes, dtypes,
constants) of the graph runs once on real tensors of the graph's device,
under the allocator's bookkeeping (the profiler's allocation events on CPU,
``max_memory_allocated`` on CUDA). Graphs on the meta device, or with ops
that cannot run on synthetic inputs, get 0 for those nodes.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from .._torch_compat import EventType, disable_current_modes
from ..quiet import quiet_stderr

__all__ = ["measure_scratch", "MAX_CALIBRATION_BYTES"]

log = logging.getLogger(__name__)

# Calibration allocates each op's inputs for real; skip ops whose inputs and
# outputs together exceed this (1 GiB), so planning never risks an OOM itself.
MAX_CALIBRATION_BYTES = 1 << 30


def _hint(x) -> int:
    return int(optimization_hint(x)) if isinstance(x, torch.SymInt) else int(x)


def _materialize(val, device_override=None):
    """A real tensor shaped like a FakeTensor ``val`` (zeros for ints and bools: valid indices)."""
    shape = [_hint(s) for s in val.shape]
    stride = [_hint(s) for s in val.stride()]
    device = device_override or val.device
    # Fill the backing storage, then view it: expanded (stride 0) tensors cannot be written.
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
    flat = torch.empty(extent, dtype=val.dtype, device=device)
    if val.dtype.is_floating_point or val.dtype.is_complex:
        flat.uniform_(0.1, 1.0)  # positive: safe for log, sqrt, division
    else:
        flat.zero_()
    return flat.as_strided(shape, stride)


def _signature(node: fx.Node) -> tuple:
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(_hint(s) for s in v.shape), tuple(_hint(s) for s in v.stride()), v.dtype)
            return ("V", repr(v))
        return ("C", repr(a))

    args = fx.node.map_aggregate(node.args, sig)
    kwargs = fx.node.map_aggregate(node.kwargs, sig)
    return (node.target, repr(args), repr(kwargs))


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return _hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def measure_scratch(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Scratch bytes of each call_function node, measured once per distinct signature.

    Args:
        nodes: fx nodes with FakeTensor ``meta["val"]``.

    Returns:
        node -> bytes allocated while it runs beyond its outputs (0 where unknown).
    """
    first: dict[tuple, fx.Node] = {}
    keyed: list[tuple[fx.Node, tuple]] = []
    for node in nodes:
        if node.op != "call_function" or node.target is operator.getitem or not isinstance(node.target, torch._ops.OpOverload):
            continue
        val = node.meta.get("val")
        tensors = [v for v in (a.meta.get("val") for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if not tensors or "meta" in devices or len(devices) > 1:
            continue
        if _nbytes(val) + sum(_nbytes(t) for t in tensors) > MAX_CALIBRATION_BYTES:
            continue
        key = _signature(node)
        first.setdefault(key, node)
        keyed.append((node, key))
    if not first:
        return {}
    # Real tensors (outside AOTAutograd's fake mode); random ops must not move the user's RNG.
    with disable_current_modes(), torch.random.fork_rng(devices=[]), torch.no_grad():
        cuda = [k for k, n in first.items() if _device(n).type == "cuda"]
        cpu = [k for k in first if k not in set(cuda)]
        measured = {k: _run_cuda(first[k]) for k in cuda}
        measured.update(_run_cpu([(k, first[k]) for k in cpu]))
    return {node: measured.get(key, 0) for node, key in keyed}


def _device(node: fx.Node) -> torch.device:
    return next(a.meta["val"].device for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))


def _prepare(node: fx.Node):
    real = {}
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        real[a] = _materialize(v) if isinstance(v, torch.Tensor) else v
    args = fx.node.map_arg(node.args, lambda a: real[a])
    kwargs = fx.node.map_arg(node.kwargs, lambda a: real[a])
    op = node.target
    # Only OpOverload call_function nodes are measured (see ``measure_scratch``).
    assert callable(op), f"{node.format_node()}: target is not callable"
    return lambda: op(*args, **kwargs)


def _scratch(node: fx.Node, peak: int, out) -> int:
    # The simulation allocates a single tensor output at the node itself, but the
    # elements of a tuple output at the getitems that follow: count those as scratch
    # of the node, so the moment the op runs carries its whole peak.
    schema = getattr(node.target, "_schema", None)
    aliased = schema is not None and schema.returns and schema.returns[0].alias_info is not None
    produced = 0 if aliased or not isinstance(out, torch.Tensor) else _nbytes(out)
    return max(0, peak - produced)


def _run_cuda(node: fx.Node) -> int:
    try:
        call = _prepare(node)
        device = _device(node)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = call()
        torch.cuda.synchronize(device)
        return _scratch(node, torch.cuda.max_memory_allocated(device) - before, out)
    except Exception as exc:  # an op that rejects synthetic inputs: no scratch known, say so
        log.debug("scratch of %s not measured (%s: %s)", node.target, type(exc).__name__, exc)
        return 0


def _run_cpu(items: list[tuple[tuple, fx.Node]]) -> dict[tuple, int]:
    """Run every op once inside one profiler session, each under its own marker."""
    if torch.autograd.profiler._is_profiler_enabled:
        # A profiler is already running (compiling inside fxremat.measure or a user's
        # trace): sessions do not nest, so CPU workspace is unknown for this graph.
        log.info("a profiler is active: op scratch not measured for this graph (counted as 0)")
        return {}
    outs: dict[int, object] = {}
    with quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, (_, node) in enumerate(items):
            try:
                call = _prepare(node)
                with torch.profiler.record_function(f"{_MARKER}{i}"):
                    out = call()
                outs[i] = out
                del out
            except Exception as exc:  # an op that rejects synthetic inputs: no scratch known, say so
                log.debug("scratch of %s not measured (%s: %s)", node.target, type(exc).__name__, exc)
    result: dict[tuple, int] = {}
    for event in prof.profiler.kineto_results.experimental_event_tree():
        _collect(event, items, outs, result)
    return result


_MARKER = "fxremat.scratch."


def _collect(event, items, outs, result) -> None:
    name = event.name
    if name.startswith(_MARKER):
        i = int(name[len(_MARKER):])
        if i in outs:
            sizes: list[tuple[int, int]] = []
            stack = list(event.children)
            while stack:
                e = stack.pop()
                if e.typed[0] == EventType.Allocation:
                    sizes.append((e.start_time_ns, e.typed[1].alloc_size))
                stack.extend(e.children)
            live = peak = 0
            for _, size in sorted(sizes):
                live += size
                peak = max(peak, live)
            key, node = items[i]
            result[key] = _scratch(node, peak, outs[i])
        return
    for child in event.children:
        _collect(child, items, outs, result)
