"""The ``cpu`` hardware profile, measured once on this host and cached.

A short microbenchmark (well under a second) times an fp32 matmul for peak
FLOP/s, a large copy for memory bandwidth, and a tiny op for per-op overhead.
The result is cached in ``~/.cache/fxremat/cpu-<torch version>-<threads>.json``
(``FXREMAT_CACHE_DIR`` overrides the folder) so compiles do not repeat it.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from .._torch_compat import disable_current_modes

__all__ = ["measure_cpu", "cache_path"]

log = logging.getLogger(__name__)

# Sizes: a 512^3 matmul (~0.27 GFLOP) runs at the rate BLAS reaches on the
# mid-size matmuls of real layers, below the peak of huge ones; a 64 MiB copy
# exceeds any cache. The median of the reps resists a noisy shared host.
_MATMUL_N = 512
_COPY_BYTES = 64 << 20
_REPS = 5


def cache_path() -> Path:
    folder = Path(os.environ.get("FXREMAT_CACHE_DIR", Path.home() / ".cache" / "fxremat"))
    return folder / f"cpu-{torch.__version__}-{torch.get_num_threads()}.json"


def _median(fn, reps: int = _REPS) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_cpu() -> tuple[float, float, float]:
    """(peak FLOP/s, bandwidth bytes/s, per-op seconds) of this host, from the cache when present."""
    path = cache_path()
    try:
        data = json.loads(path.read_text())
        return data["peak_flops"], data["bandwidth"], data["launch_seconds"]
    except (OSError, ValueError, KeyError):
        pass
    # Planning runs inside AOTAutograd's fake mode: time real tensors.
    with disable_current_modes(), torch.no_grad():
        a = torch.randn(_MATMUL_N, _MATMUL_N)
        b = torch.randn(_MATMUL_N, _MATMUL_N)
        flops = 2 * _MATMUL_N**3 / _median(lambda: torch.mm(a, b))
        src = torch.empty(_COPY_BYTES // 4)
        dst = torch.empty_like(src)
        bandwidth = 2 * _COPY_BYTES / _median(lambda: dst.copy_(src))  # read + write
        tiny = torch.ones(1)
        launch = _median(lambda: [tiny.add(1) for _ in range(100)]) / 100
    data = {"peak_flops": flops, "bandwidth": bandwidth, "launch_seconds": launch}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    except OSError as exc:  # a read-only home: measure again next time, say so
        log.info("could not cache the cpu profile at %s: %s", path, exc)
    log.info("cpu profile: %.1f GFLOP/s, %.1f GB/s, %.1f us/op", flops / 1e9, bandwidth / 1e9, launch * 1e6)
    return flops, bandwidth, launch
