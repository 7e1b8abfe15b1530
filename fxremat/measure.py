"""Measure the peak memory and the wall time of one training step.

This is the ground truth the planner's predictions are checked against (see
DESIGN.md, "What the budget means"): :func:`measure` runs a zero-argument
training step and reports the peak of live memory the step allocates above
what existed right before it, a memory timeline, and the median step time.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from ._torch_compat import EventType
from .budget import format_bytes
from .quiet import quiet_stderr

__all__ = ["Measurement", "measure", "format_bytes"]

logger = logging.getLogger(__name__)

# A timeline longer than this is decimated (min and max of each bucket kept,
# so the peak survives). 2000 points draw a smooth plot and stay small to log.
MAX_TIMELINE_POINTS = 2000

# Name of the profiler annotation around the measured step; its start and end
# bound the allocation events that belong to the step.
_STEP_ANNOTATION = "fxremat.measure.step"

# Read through the module so that tests can substitute a deterministic clock.
_clock = time.perf_counter


# ---------------------------------------------------------------------------
# Result type
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What :func:`measure` observed for one training step.

    Attributes:
        peak_bytes: Peak live bytes allocated during the step above the
            baseline right before it (see :func:`measure` for what is counted).
        step_seconds: Median wall time of the timed steps, in seconds.
        all_step_seconds: Wall time of every timed step, in run order.
        timeline: ``(seconds since step start, live bytes above baseline)``
            after every allocation and free of the measured step, starting at
            ``(0.0, 0)``; decimated to at most ``MAX_TIMELINE_POINTS`` points
            with the peak kept.
        device: The device whose memory was measured, e.g. ``"cpu"`` or
            ``"cuda:0"``.
    """

    peak_bytes: int
    step_seconds: float
    all_step_seconds: tuple[float, ...]
    timeline: tuple[tuple[float, int], ...]
    device: str

    def __str__(self) -> str:
        return (
            f"{self.device}: peak {format_bytes(self.peak_bytes)} above baseline, "
            f"step {_format_seconds(self.step_seconds)} "
            f"(median of {len(self.all_step_seconds)})"
        )


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------


def measure(
    step: Callable[[], object],
    *,
    reps: int = 3,
    warmup: int = 1,
    device: Union[str, torch.device, None] = None,
) -> Measurement:
    """Measure the peak memory and the median wall time of a training step.

    ``step`` is a zero-argument callable running one training step (forward +
    backward), e.g. ``lambda: model(x).sum().backward()``. Its return value is
    dropped as soon as it returns.

    Order of runs: ``warmup`` untimed steps, then one memory-measured step,
    then ``reps`` timed steps. The warm-up and memory steps run under the
    profiler; the timed steps do not.

    What is counted: the peak of live memory allocated during the step above
    the baseline that existed right before it. Parameters, inputs, and
    parameter ``.grad`` buffers already allocated by warm-up steps are in the
    baseline, so not counted; everything the forward and backward allocate is
    counted, including the gradients the backward returns until autograd
    accumulates them into ``.grad``, and tangents autograd creates (such as the
    ones that ``loss.backward()`` seeds). Memory is counted by allocation (a
    view costs nothing). A free of memory that existed before the step lowers
    the running total below the baseline; the peak is never below 0.

    - On CPU: measured with the torch profiler's allocation events
      (``profile_memory=True``), replaying every allocation and free of the
      profiled step in time order and taking the running-sum peak (relative to
      start = 0). The profiler sees the calling thread and autograd's worker
      threads, not threads the step starts itself. It also cannot see the
      free of a CPU block allocated before profiling began (before
      ``measure`` was called): such a free is ignored, so the total does not
      drop. Frees of blocks the warm-up steps allocated are seen, as on CUDA.
    - On CUDA: ``torch.cuda.reset_peak_memory_stats``, then
      ``max_memory_allocated() - memory_allocated()`` before the step,
      synchronised. The timeline comes from the same step's profiler events
      for that device. Both count the caching allocator's blocks (sizes
      rounded up to 512 B), not the reserved segments.

    Step time: median wall time over ``reps`` steps run WITHOUT the profiler
    (the profiler slows things), after the warm-up and memory steps; on CUDA
    each timed step is synchronised before and after.

    Python's cyclic garbage collector is paused during the memory step, so
    that it does not free pre-existing objects mid-step.

    Args:
        step: Zero-argument callable that runs one forward and backward.
        reps: Number of timed steps (at least 1).
        warmup: Number of untimed steps first (at least 0). With ``warmup=0``
            the memory step is the very first step, so the parameter ``.grad``
            buffers it creates are counted.
        device: Device whose memory is measured (``"cpu"``, ``"cuda"``,
            ``"cuda:1"`` or a ``torch.device``). ``None``: the current CUDA
            device if the memory step allocated CUDA memory there, else CPU
            (when CUDA is initialised, its peak statistics are reset either
            way).

    Returns:
        A :class:`Measurement`.

    Raises:
        ValueError: ``reps`` < 1, ``warmup`` < 0, or an unsupported device.
        RuntimeError: A CUDA device was requested but CUDA is not available.

    Example:
        >>> import torch
        >>> from fxremat.measure import measure
        >>> model = torch.nn.Linear(256, 256)
        >>> x = torch.randn(64, 256)
        >>> m = measure(lambda: model(x).sum().backward(), reps=3)
        >>> m.peak_bytes >= 64 * 256 * 4  # the output is allocated in the step
        True
        >>> print(m)  # doctest: +SKIP
        cpu: peak 320.0 KiB above baseline, step 1.23 ms (median of 3)
    """
    if reps < 1:
        raise ValueError(f"measure: reps={reps}; pass reps >= 1 (the number of timed steps).")
    if warmup < 0:
        raise ValueError(f"measure: warmup={warmup}; pass warmup >= 0.")
    requested = _parse_device(device)

    peak_bytes, timeline, measured = _measure_memory(step, warmup, requested)

    sync = _cuda_sync_fn(measured)
    seconds = []
    for _ in range(reps):
        sync()
        start = _clock()
        step()
        sync()
        seconds.append(_clock() - start)

    result = Measurement(
        peak_bytes=peak_bytes,
        step_seconds=float(statistics.median(seconds)),
        all_step_seconds=tuple(seconds),
        timeline=timeline,
        device=str(measured),
    )
    logger.debug("measure: %s; %d timeline points", result, len(timeline))
    return result


def _measure_memory(
    step: Callable[[], object], warmup: int, requested: Optional[torch.device]
) -> tuple[int, tuple[tuple[float, int], ...], torch.device]:
    """Run the warm-up steps and one measured step under the profiler.

    The warm-up steps are profiled too (but not replayed) so that the CPU
    allocator knows the size of what they allocate: a free of such a block in
    the measured step (e.g. ``zero_grad(set_to_none=True)``) then shows up as
    an event instead of being invisible.

    Returns:
        (peak bytes, timeline, measured device).
    """
    with (
        quiet_stderr(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        for _ in range(warmup):
            step()
        # Chosen after the warm-up, which may be what initialises CUDA.
        cuda = _cuda_candidate(requested)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            if cuda is not None:
                torch.cuda.synchronize(cuda)
                torch.cuda.reset_peak_memory_stats(cuda)
                cuda_base = torch.cuda.memory_allocated(cuda)
            with torch.profiler.record_function(_STEP_ANNOTATION):
                step()
                if cuda is not None:
                    torch.cuda.synchronize(cuda)
            if cuda is not None:
                cuda_peak = torch.cuda.max_memory_allocated(cuda) - cuda_base
        finally:
            if gc_was_enabled:
                gc.enable()

    start_ns, end_ns, allocations = _step_allocations(prof)
    if requested is None:
        allocated_on_cuda = cuda is not None and any(d == cuda for d, _, _ in allocations)
        measured = cuda if cuda is not None and allocated_on_cuda else torch.device("cpu")
    else:
        measured = requested

    points = _replay([(t, size) for d, t, size in allocations if d == measured], start_ns, end_ns)
    replay_peak = max(live for _, live in points)
    if measured.type == "cuda":
        peak = int(cuda_peak)
        logger.debug(
            "measure: %s peak %d B from allocator stats, %d B from profiler replay",
            measured,
            peak,
            replay_peak,
        )
    else:
        peak = replay_peak
    return peak, _decimate(points, MAX_TIMELINE_POINTS), measured


def _step_allocations(
    prof: torch.profiler.profile,
) -> tuple[int, int, list[tuple[torch.device, int, int]]]:
    """Step window and its allocation events ``(device, start ns, +/- bytes)``.

    Events from every thread are included (the autograd engine may run the
    backward on its own threads), in time order; ties keep the event-tree order.
    """
    # Both are set once the profiler's context has exited; None means it never ran.
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("measure: the profiler returned no results; is another profiler already running?")
    roots = results.experimental_event_tree()
    window = None
    allocations = []
    for event in _walk(roots):
        kind = event.typed[0]
        if kind == EventType.Allocation:
            info = event.typed[1]
            allocations.append((torch.device(info.device), event.start_time_ns, info.alloc_size))
        elif window is None and event.name == _STEP_ANNOTATION:
            window = (event.start_time_ns, event.end_time_ns)
    if window is None:
        raise RuntimeError(
            f"measure: the profiler recorded no '{_STEP_ANNOTATION}' annotation, so the "
            "step cannot be located; is another profiler already running?"
        )
    start_ns, end_ns = window
    inside = [a for a in allocations if start_ns <= a[1] <= end_ns]
    inside.sort(key=lambda a: a[1])
    return start_ns, end_ns, inside


def _walk(roots: Sequence) -> Iterator:
    """Pre-order walk of the profiler's event tree, without recursion."""
    stack = list(reversed(roots))
    while stack:
        event = stack.pop()
        yield event
        stack.extend(reversed(event.children))


def _replay(deltas: Sequence[tuple[int, int]], start_ns: int, end_ns: int) -> list[tuple[float, int]]:
    """Running sum of ``(time ns, +/- bytes)`` as ``(seconds since start, live)``."""
    live = 0
    points = [(0.0, 0)]
    for t_ns, size in deltas:
        live += size
        points.append(((t_ns - start_ns) * 1e-9, live))
    points.append(((end_ns - start_ns) * 1e-9, live))
    return points


def _decimate(points: Sequence[tuple[float, int]], limit: int) -> tuple[tuple[float, int], ...]:
    """At most ``limit`` points: first, last, and each bucket's min and max.

    Keeping both extremes of every bucket preserves the peak and the troughs.
    """
    if len(points) <= limit:
        return tuple(points)
    inner = points[1:-1]
    buckets = max(1, (limit - 2) // 2)
    kept = [points[0]]
    for b in range(buckets):
        chunk = range(b * len(inner) // buckets, (b + 1) * len(inner) // buckets)
        if not chunk:
            continue
        lo = min(chunk, key=lambda i: inner[i][1])
        hi = max(chunk, key=lambda i: inner[i][1])
        kept.extend(inner[i] for i in sorted({lo, hi}))
    kept.append(points[-1])
    return tuple(kept)


# ---------------------------------------------------------------------------
# Devices and formatting
# ---------------------------------------------------------------------------


def _parse_device(device: Union[str, torch.device, None]) -> Optional[torch.device]:
    """Normalise the ``device`` argument; ``cuda`` gets an explicit index."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"measure: device={str(device)!r} but CUDA is not available; "
                "pass device='cpu' or run on a machine with a GPU."
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    raise ValueError(f"measure: device={str(device)!r} is not supported; pass 'cpu', 'cuda', 'cuda:N' or None.")


def _cuda_candidate(requested: Optional[torch.device]) -> Optional[torch.device]:
    """The CUDA device whose allocator stats to record for this step, if any."""
    if requested is not None:
        return requested if requested.type == "cuda" else None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _cuda_sync_fn(device: torch.device) -> Callable[[], None]:
    """A no-op on CPU; ``torch.cuda.synchronize(device)`` on CUDA."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _format_seconds(seconds: float) -> str:
    """``"1.23 s"``, ``"45.6 ms"`` or ``"789 us"``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
