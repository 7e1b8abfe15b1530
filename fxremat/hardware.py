"""Hardware profiles for the cost model's time estimate, and the ``cpu`` microbenchmark.

A ``Hardware`` holds the rates of one device: ``a100``, ``h100`` and ``h200``
come from datasheets; ``cpu`` is this host, measured once and cached.

The ``cpu`` profile: a short microbenchmark (about half a second) measures the
rates that graph ops actually reach here, each the way the graph runs it (an
aten op called from Python, allocating its output, on torch's current thread
count):

- ``launch_seconds``: the median over a dozen kinds of op a layer runs (add, gelu,
  layer norm, softmax, addmm, attention, ...) of one call's time at 16 tokens x 64
  hidden, where data and FLOPs take a microsecond or two (dispatch, allocation,
  kernel set-up);
- ``view_seconds``: one call of ``aten.view`` (dispatch only, no data);
- ``peak_flops``: fp32 ``aten.addmm`` at a layer's shape (1024 tokens, 512 -> 1024);
- ``attention_flops``: causal SDPA (CPU flash attention) at (2, 8, 256, 64);
- ``bandwidth``: ``aten.add`` of two 8 MiB tensors into a new output (bytes read
  plus written per second; most activations of small models sit in cache);
- ``fresh_bandwidth``: the first write to a new 64 MiB block (page faults; glibc
  maps every block of 32 MiB or more afresh, see ``FRESH_OUTPUT_BYTES``).

Each rate is the median of a few reps: what the op typically reaches on this
host as loaded at the time. A shared host changes speed with its neighbours'
load (docs/COST_MODEL.md measures 2-10x on a 2-vCPU host), which no profile
measured once predicts; ``calibrate=True`` times the graph's own ops at
compile time instead, and deleting the cached file measures the host again.

The result is cached in ``~/.cache/fxremat/cpu-v2-<torch version>-<threads>.json``
(``FXREMAT_CACHE_DIR`` overrides the folder) so compiles do not repeat it.

One moment is never cached: torch's threads waiting for one another. When another
process holds a core, GNU OpenMP's workers spin for their descheduled peer and an op
on all threads takes many times its one-thread time (an 8 MiB add: 8.0 ms against
0.65 ms on one thread, where the quiet host runs it on two threads in 0.33 ms).
Measured then, the profile times the stalls, not the host (3.2 GB/s of bandwidth
against 64-71 GB/s quiet), and every later plan would follow it. So the add is timed
on all threads and on one, before the measurement and inside it (the add the bandwidth
comes from, then the same on one thread); a stalled measurement is taken again
(``STALL_TRIES``), and one that stays stalled serves this process only, with a
warning, and is not cached.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ._torch_compat import disable_current_modes

__all__ = [
    "Hardware",
    "HARDWARE",
    "FRESH_OUTPUT_BYTES",
    "get_hardware",
    "measure_cpu",
    "cache_path",
    "CACHE_VERSION",
    "STALL_RATIO",
    "STALL_TRIES",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hardware:
    """Rates of a device for the roofline time estimate."""

    name: str
    peak_flops: float
    """FLOP/s for the dtype the model trains in (dense matmul)."""
    bandwidth: float
    """Bytes/s that ops read and write at."""
    launch_seconds: float
    """Fixed cost of running one op (kernel launch, or dispatch on CPU)."""
    attention_flops: float | None = None
    """FLOP/s of fused attention kernels, counted as ``torch.utils.flop_counter``
    counts them (the whole s x s score matrix, causal or not); None: ``peak_flops``."""
    view_seconds: float = 0.0
    """Cost of a view op (no data moved): its dispatch on CPU; 0 on GPUs, where the
    host-side dispatch overlaps the kernels already queued."""
    fresh_bandwidth: float = math.inf
    """Bytes/s at which an op first writes an output of at least ``FRESH_OUTPUT_BYTES``
    (page faults on freshly mapped memory); inf where the allocator caches memory (GPUs)."""


# glibc's malloc serves every block of at least 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX
# on 64-bit, mallopt(3)) with a fresh mmap, and PyTorch's CPU allocator does not
# cache: such an output is page-faulted in on every step (docs/COST_MODEL.md).
FRESH_OUTPUT_BYTES = 32 << 20

HARDWARE = {
    # This host, measured once by a microbenchmark and cached (``measure_cpu`` below).
    "cpu": None,
    # NVIDIA A100 SXM datasheet: 312 TFLOP/s bf16 dense, 2.0 TB/s HBM2e; ~5 us per kernel launch.
    "a100": Hardware("a100", 312e12, 2.0e12, 5e-6),
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3.
    "h100": Hardware("h100", 989e12, 3.35e12, 5e-6),
    # NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e.
    "h200": Hardware("h200", 989e12, 4.8e12, 5e-6),
}


def get_hardware(name: str) -> Hardware:
    """The named profile (``cpu`` is measured on first use, then read from its cache).

    Args:
        name: a key of ``HARDWARE``.

    Returns:
        The profile's rates.

    Raises:
        ValueError: ``name`` is not a profile; the message lists the valid ones.

    Example:
        >>> get_hardware("h100").peak_flops
        989000000000000.0
    """
    if name not in HARDWARE:
        raise ValueError(f"hardware={name!r} is not a known profile; choose one of {sorted(HARDWARE)}")
    if name == "cpu":
        return Hardware("cpu", **measure_cpu())
    profile = HARDWARE[name]
    assert profile is not None  # only "cpu" is measured rather than listed
    return profile


# ------------------------------------------------------------ the cpu microbenchmark

# Bump when what is measured changes, so stale profiles are not reused.
# v2: per-op fixed cost of a layer's op mix, view dispatch, layer-shaped matmul, attention,
# pointwise bandwidth, fresh pages.
CACHE_VERSION = 2
# A layer's matmul: 1024 tokens x hidden 512 -> 1024 (1.07 GFLOP, 6-25 ms on 1-2
# threads here). Small-model matmuls reach less than huge ones; this is the middle.
_MM_M, _MM_K, _MM_N = 1024, 512, 1024
# Causal attention at (batch 2, 8 heads, 256 tokens, head dim 64): 0.27 GFLOP as
# flop_counter counts it (4*b*h*s*s*d); CPU flash attention reaches about half the
# matmul rate per counted FLOP here (docs/COST_MODEL.md).
_ATTN_SHAPE = (2, 8, 256, 64)
# A mid-size activation (2M fp32 elements): above torch's parallel grain (32768
# elements), so the op runs on all threads, as real activations do.
_POINTWISE_BYTES = 8 << 20
# Above glibc's largest mmap threshold (32 MiB), so every allocation is fresh pages.
_FRESH_BYTES = 64 << 20
# Calls per sample for the microsecond-scale ops, so the timer's resolution does not matter.
_TINY_CALLS = 50
# Median of several reps: the rate ops typically reach on this host as it is loaded
# when measured (a best-of would report a quiet moment that a shared host rarely
# gives); cheap ops get more reps. Each measurement stays under about 0.2 s.
_REPS = 7
_MM_REPS = 7
_POINTWISE_REPS = 11
_FRESH_REPS = 3
# Threads waiting for one another: the pointwise add on all threads takes more than this many times
# its one-thread time (stalled: 10-20x here; quiet: about 0.5x on two threads).
STALL_RATIO = 1.5
# Measurements tried before a stalled one is used uncached, and the pause between them.
STALL_TRIES = 3
_STALL_PAUSE_SECONDS = 0.5
# Profiles measured stalled, kept for this process only (by cache path): measured once per process.
_UNCACHED: dict[Path, dict[str, float]] = {}


def cache_path() -> Path:
    """Where this host's profile is cached (one file per torch version and thread count)."""
    folder = Path(os.environ.get("FXREMAT_CACHE_DIR", Path.home() / ".cache" / "fxremat"))
    return folder / f"cpu-v{CACHE_VERSION}-{torch.__version__}-{torch.get_num_threads()}.json"


def _median(fn, calls: int = 1, reps: int = _REPS) -> float:
    """Median per-call seconds of ``fn`` over ``reps`` samples of ``calls`` calls (after two warm-ups:
    the first allocations of a size also move malloc's thresholds)."""
    fn()
    fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t) / calls)
    return statistics.median(samples)


def _small_ops() -> list:
    """The kinds of op a transformer layer runs, at 16 tokens x 64 hidden, where their
    data and FLOPs take a microsecond or two: what remains is each op's fixed cost
    (3-15 us here: dispatch, allocation, kernel set-up; more for fused kernels)."""
    aten = torch.ops.aten
    x, w, b = torch.randn(16, 64), torch.randn(64, 64), torch.randn(64)
    q, ids = torch.randn(1, 4, 16, 16), torch.zeros(16, dtype=torch.long)
    return [
        lambda: aten.add.Tensor(x, x),
        lambda: aten.mul.Tensor(x, x),
        lambda: aten.tanh.default(x),
        lambda: aten.gelu.default(x),
        lambda: aten.clone.default(x),
        lambda: aten.sum.dim_IntList(x, [-1]),
        lambda: aten.cat.default([x, x], -1),
        lambda: aten._softmax.default(x, -1, False),
        lambda: aten.native_layer_norm.default(x, [64], b, b, 1e-5),
        lambda: aten.embedding.default(w, ids),
        lambda: aten.addmm.default(b, x, w.t()),
        lambda: aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True),
    ]


def _measure() -> tuple[dict[str, float], float]:
    """The rates, and the stall ratio of the add they take the bandwidth from (``_stall_ratio``)."""
    aten = torch.ops.aten
    # The median kind: one or two kinds caught waiting for a descheduled thread (ms on a
    # shared host, docs/COST_MODEL.md) do not set every op's cost.
    launch = statistics.median(_median(op, calls=_TINY_CALLS) for op in _small_ops())
    small = torch.ones(64, 64)
    view = _median(lambda: aten.view.default(small, [4096]), calls=_TINY_CALLS)
    a, w, bias = torch.randn(_MM_M, _MM_K), torch.randn(_MM_N, _MM_K), torch.randn(_MM_N)
    mm = _median(lambda: aten.addmm.default(bias, a, w.t()), reps=_MM_REPS)
    q = torch.randn(_ATTN_SHAPE)
    attn = _median(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    b, h, s, d = _ATTN_SHAPE
    x = torch.randn(_POINTWISE_BYTES // 4)
    add = _add_seconds(x)
    stall = 1.0 if torch.get_num_threads() == 1 else add / max(_on_one_thread(lambda: _add_seconds(x)), 1e-9)
    fresh = _median(lambda: torch.empty(_FRESH_BYTES // 4).fill_(1.0), reps=_FRESH_REPS)
    bandwidth = 3 * _POINTWISE_BYTES / max(add - launch, 1e-9)  # two reads, one write
    # The fill itself writes at ``bandwidth``; the rest of the time is page faults.
    faults = max(fresh - launch - _FRESH_BYTES / bandwidth, 1e-9)
    rates = {
        "peak_flops": 2 * _MM_M * _MM_K * _MM_N / max(mm - launch, 1e-9),
        "attention_flops": 4 * b * h * s * s * d / max(attn - launch, 1e-9),
        "bandwidth": bandwidth,
        "launch_seconds": launch,
        "view_seconds": view,
        "fresh_bandwidth": _FRESH_BYTES / faults,
    }
    return rates, stall


def _add_seconds(x: torch.Tensor) -> float:
    """Median seconds of ``x + x``: the add the bandwidth is taken from, and the stall check's."""
    return _median(lambda: torch.ops.aten.add.Tensor(x, x), reps=_POINTWISE_REPS)


def _on_one_thread(fn):
    """``fn()`` with torch on one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _stall_ratio() -> float:
    """The pointwise add's time on all of torch's threads over its time on one: above ``STALL_RATIO``,
    the threads wait for one another (1.0 with one thread)."""
    if torch.get_num_threads() == 1:
        return 1.0
    x = torch.randn(_POINTWISE_BYTES // 4)
    return _add_seconds(x) / max(_on_one_thread(lambda: _add_seconds(x)), 1e-9)


def _measure_unstalled() -> tuple[dict[str, float], float]:
    """``_measure()``'s rates and the larger stall ratio of the check before it and of its own add:
    the first measurement with neither stalled, else (``STALL_TRIES`` used up) the last one taken."""
    for attempt in range(STALL_TRIES):
        if attempt:
            time.sleep(_STALL_PAUSE_SECONDS)
        before = _stall_ratio()
        if before > STALL_RATIO and attempt < STALL_TRIES - 1:
            continue  # stalled now: wait rather than time a stalled measurement
        data, inside = _measure()
        ratio = max(before, inside)
        if ratio <= STALL_RATIO:
            break
    return data, ratio


# The fields a cached profile must have (the Hardware fields measure_cpu fills).
_FIELDS = {"peak_flops", "attention_flops", "bandwidth", "launch_seconds", "view_seconds", "fresh_bandwidth"}


def measure_cpu() -> dict[str, float]:
    """This host's rates as ``Hardware`` fields (peak_flops, attention_flops, bandwidth,
    launch_seconds, view_seconds, fresh_bandwidth), from the cache when present.

    A measurement during which torch's threads kept waiting for one another (another
    process on the cores; module docstring) is not cached: it warns once and serves this
    process only.

    Returns:
        Field name -> value, for ``Hardware("cpu", **measure_cpu())``.
    """
    path = cache_path()
    if path in _UNCACHED:
        return _UNCACHED[path]
    try:
        data = json.loads(path.read_text())
        if set(data) == _FIELDS:
            return data
    except (OSError, ValueError):
        pass
    t0 = time.perf_counter()
    # Planning runs inside AOTAutograd's fake mode: time real tensors.
    with disable_current_modes(), torch.no_grad():
        data, ratio = _measure_unstalled()
    if ratio > STALL_RATIO:
        _UNCACHED[path] = data
        warnings.warn(
            f"fxremat: torch's {torch.get_num_threads()} threads kept waiting for one another while this host's cpu "
            f"profile was measured (an 8 MiB add took {ratio:.1f}x its one-thread time, {STALL_TRIES} tries): another "
            "process is using the cores. This process's time estimates, and so its plans, follow that moment; the "
            f"profile is not cached at {path}. Run with one thread (torch.set_num_threads(1)) or "
            "OMP_WAIT_POLICY=passive, or compile when the host is quieter.",
            stacklevel=2,
        )
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data))
        except OSError as exc:  # a read-only home: measure again next time, say so
            log.info("could not cache the cpu profile at %s: %s", path, exc)
    log.info(
        "cpu profile in %.2f s: %.1f GFLOP/s (attention %.1f), %.1f GB/s, %.1f us/op, %.1f us/view, "
        "%.2f GB/s fresh pages",
        time.perf_counter() - t0,
        data["peak_flops"] / 1e9,
        data["attention_flops"] / 1e9,
        data["bandwidth"] / 1e9,
        data["launch_seconds"] * 1e6,
        data["view_seconds"] * 1e6,
        data["fresh_bandwidth"] / 1e9,
    )
    return data
