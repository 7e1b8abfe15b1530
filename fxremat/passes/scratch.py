"""Scratch pass: bytes an op allocates inside itself beyond its outputs.

Some kernels allocate workspace that never appears in the graph: CPU
convolution's im2col columns, dropout's float noise before the mask, cuBLAS
and cuDNN workspaces. The liveness simulation adds each node's scratch to the
live bytes while the node runs, so predicted peaks match measured ones.

Scratch is measured, not guessed: each distinct (op, argument shapes, strides,
dtypes, constants) of the graph runs once on real tensors of the graph's device,
under the allocator's bookkeeping (the profiler's allocation events on CPU,
``max_memory_allocated`` on CUDA). Graphs on the meta device, or with ops
that cannot run on synthetic inputs, get 0 for those nodes.

A measurement is kept for the process (``_KNOWN``): a graph planned again (a
re-plan inside a running step, perhaps under a profiler, where CPU workspace
cannot be measured) or another graph with the same op reuses it, and does not
run the op again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx as fx

from .._torch_compat import EventType, op_schema, profiler_is_enabled
from ..quiet import quiet_stderr
from .opinfo import is_op_call, nbytes_hint, size_hint, strides_hint
from .oprun import MAX_STANDALONE_BYTES, OpCall, node_of_call, op_signature, real_tensors, standalone_call

__all__ = ["measure_scratch", "ScratchAt"]

log = logging.getLogger(__name__)


# (op signature, device, input strides or None for the graph's own) -> workspace bytes measured
# in this process. Only measurements are kept: an op that could not run (a profiler active) is
# tried again by the next graph that has it.
_KNOWN: dict[tuple, int] = {}


def measure_scratch(nodes: list[fx.Node], channels_last: bool = False) -> dict[fx.Node, int]:
    """Scratch bytes of each call_function node, measured once per distinct signature.

    Args:
        nodes: fx nodes with FakeTensor ``meta["val"]``.
        channels_last: convolutions (forward and backward) are measured with their 4-d tensor
            inputs channels-last, as Inductor's layout optimisation runs them; their workspace
            depends on it (a 16-channel 64 x 64 ``convolution_backward`` at batch 16 on CPU:
            8.4 MB contiguous, none channels-last).

    Returns:
        node -> bytes allocated while it runs beyond its outputs (0 where unknown).
    """
    first: dict[tuple, fx.Node] = {}
    keyed: list[tuple[fx.Node, tuple]] = []
    layouts: dict[tuple, Strides] = {}
    for node in nodes:
        if not _measurable(node):
            continue
        layout = _channels_last(node) if channels_last else None
        # Keyed by the input strides as ``ScratchAt`` keys them: its replay asks for these same runs.
        key = (op_signature(node), None if layout is None else _strides(node, layout))
        if layout is not None and key not in first:
            layouts[key] = layout  # the inputs of the node that runs for the key
        first.setdefault(key, node)
        keyed.append((node, key))
    if not first:
        return {}
    known = {k: _known_key(k[0], k[1], n) for k, n in first.items()}
    measured = {k: _KNOWN[known[k]] for k in first if known[k] in _KNOWN}
    todo = {k: n for k, n in first.items() if k not in measured}
    if todo:
        # Real tensors (outside AOTAutograd's fake mode); random ops must not move the user's RNG.
        with real_tensors():
            cuda = [k for k, n in todo.items() if _device(n).type == "cuda"]
            cpu = [k for k in todo if k not in set(cuda)]
            runs = {k: _run_cuda(todo[k], layouts.get(k)) for k in cuda}
            runs.update(_run_cpu([(k, todo[k]) for k in cpu if k not in layouts]))
            # One layout for the laid-out ops' inputs, in a session of their own: an input that
            # another op reads too keeps its own strides there.
            laid_out = [k for k in cpu if k in layouts]
            if laid_out:
                merged = {a: st for k in laid_out for a, st in layouts[k].items()}
                runs.update(_run_cpu([(k, todo[k]) for k in laid_out], merged))
        for k, nbytes in runs.items():
            _KNOWN[known[k]] = nbytes
        measured.update(runs)
    return {node: measured.get(key, 0) for node, key in keyed}


_CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


def _channels_last(node: fx.Node) -> Strides | None:
    """Channels-last strides for a convolution's 4-d tensor inputs, as Inductor's layout optimisation
    lays them out (symbolic sizes at their hints); None for other ops."""
    if node.target not in _CONVOLUTIONS:
        return None
    layout: Strides = {}
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 4:
            _, c, h, w = (size_hint(s) for s in val.shape)
            layout[a] = (h * w * c, 1, w * c, c)
    return layout or None


def _strides(node: fx.Node, layout: Strides) -> tuple:
    """The strides of ``node``'s tensor inputs (one tuple each, in order) with ``layout`` applied."""
    inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    return tuple(layout.get(a) or strides_hint(a.meta["val"]) for a in inputs)


def _known_key(signature: tuple, strides: tuple | None, node: fx.Node) -> tuple:
    return (signature, str(_device(node)), strides)


def _measurable(node: fx.Node) -> bool:
    """An op call whose tensor inputs sit on one real device and whose run stays small."""
    if not is_op_call(node):
        return False
    tensors = [v for v in (a.meta.get("val") for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]
    devices = {t.device.type for t in tensors}
    if not tensors or "meta" in devices or len(devices) > 1:
        return False
    return nbytes_hint(node.meta.get("val")) + nbytes_hint(tensors) <= MAX_STANDALONE_BYTES


def _device(node: fx.Node) -> torch.device:
    return next(a.meta["val"].device for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))


def _scratch(node: fx.Node, peak: int, out) -> int:
    # The simulation allocates a single tensor output at the node itself, but the
    # elements of a tuple output at the getitems that follow: count those as scratch
    # of the node, so the moment the op runs carries its whole peak.
    schema = op_schema(node.target)
    aliased = schema is not None and schema.returns and schema.returns[0].alias_info is not None
    produced = 0 if aliased or not isinstance(out, torch.Tensor) else nbytes_hint(out)
    return max(0, peak - produced)


Strides = dict[fx.Node, tuple[int, ...]]


def _call(node: fx.Node, strides: Strides | None = None) -> Callable[[], object]:
    # Symbolic sizes at their hints, never guarded: a graph with dynamic sizes stays dynamic (under a
    # budget its sizes were fixed when it came in, ``backend.fixing_sizes``, so the hints are its sizes).
    return standalone_call(node, strides=strides)


def _run_cuda(node: fx.Node, strides: Strides | None = None) -> int:
    try:
        call = _call(node, strides)
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


def _run_cpu(items: list[tuple[tuple, fx.Node]], strides: Strides | None = None) -> dict[tuple, int]:
    """Run every op once inside one profiler session, each under its own marker (inputs laid out
    with ``strides`` where it names them)."""
    if profiler_is_enabled():
        # A profiler is already running (compiling inside fxremat.measure or a user's
        # trace): sessions do not nest, so CPU workspace is unknown for this graph.
        log.info("a profiler is active: op scratch not measured for this graph (counted as 0)")
        return {}
    outs: dict[int, object] = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    with quiet_stderr(), torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        for i, (_, node) in enumerate(items):
            try:
                call = _call(node, strides)
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


# Prefix of the profiler range around each op's run; ``_collect`` finds the runs by it.
_MARKER = "fxremat.scratch."


def _collect(event, items, outs, result) -> None:
    name = event.name
    if name.startswith(_MARKER):
        i = int(name[len(_MARKER) :])
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


class ScratchAt:
    """Workspace of a graph's ops at the input strides a compiler hands them, measured on demand.

    The joint graph's strides are AOTAutograd's; Inductor lays a fallback kernel's inputs out
    its own way, and some kernels' workspace depends on the layout: timm convnext's depthwise
    7x7 ``convolution_backward`` allocates 15.5 MiB with the joint graph's mixed layouts
    (gradient contiguous, input channels-last), 0.6 MiB with the contiguous ones Inductor passes. ``measure_scratch`` measured
    each node at its own strides; this measures a node again where the strides differ (once
    per op signature and strides) and answers None where they do not.
    """

    def __init__(self, nodes: list[fx.Node]) -> None:
        self.nodes = {n.name: n for n in nodes if is_op_call(n)}  # checked by _measurable when asked
        self.measured: dict[tuple, int | None] = {}
        self.calls: dict[OpCall, tuple[fx.Node, tuple] | None] = {}
        """Each call asked for: the node that runs it and its measurement key (None: it cannot run)."""

    def __call__(self, name: str, strides: tuple, call: OpCall | None = None) -> int | None:
        """Workspace bytes of node ``name`` with its tensor inputs at ``strides`` (one tuple per
        tensor input, in order), or None when those are its own strides or it cannot be run.

        ``call``: the op call itself, for a node the compiler made (none named ``name`` here:
        Inductor's ``addmm`` of an ``mm`` and an ``add``), measured at its own strides.
        """
        node = self.nodes.get(name)
        if node is None:
            return None if call is None else self._of_call(call)
        if not _measurable(node):
            return None
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        try:
            own = tuple(strides_hint(a.meta["val"]) for a in inputs)
        except Exception:  # noqa: BLE001 - a size without a hint: keep the measurement made at graph strides
            return None
        if len(strides) != len(inputs) or tuple(map(tuple, strides)) == own or any(s is None for s in strides):
            return None
        layout = {a: tuple(st) for a, st in zip(inputs, strides)}
        return self._measure((op_signature(node), tuple(map(tuple, strides))), node, layout)

    def _of_call(self, call: OpCall) -> int | None:
        if call not in self.calls:
            node = node_of_call(call)
            self.calls[call] = (node, (op_signature(node), None)) if node is not None and _measurable(node) else None
        known = self.calls[call]
        return None if known is None else self._measure(known[1], known[0], None)

    def _measure(self, key: tuple, node: fx.Node, layout: Strides | None) -> int | None:
        """``node``'s workspace with its inputs laid out as ``layout`` says, measured once per ``key``."""
        known = _known_key(key[0], key[1], node)
        if key not in self.measured and known in _KNOWN:
            self.measured[key] = _KNOWN[known]
        if key not in self.measured:
            with real_tensors():
                if _device(node).type == "cuda":
                    self.measured[key] = _run_cuda(node, layout)
                else:
                    # None where it could not run (a profiler already active, an op that
                    # rejects the inputs): the measurement at the graph's strides stands.
                    self.measured[key] = _run_cpu([(key, node)], layout).get(key)
            nbytes = self.measured[key]
            if nbytes is not None:
                _KNOWN[known] = nbytes
        return self.measured[key]
