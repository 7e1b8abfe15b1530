"""Suite-wide settings.

The plan cache (``fxremat/plan_cache.py``) is off: a test that plans a model the
same way as an earlier test must plan it, not read the earlier plan (many tests
count solver runs and lowerings, or time them). ``tests/test_plan_cache.py``
turns it on in its own folder. Child processes inherit the setting.

Dry lowerings stay in the test's process (``FXREMAT_LOWERING_WORKERS=1``): tests count
lowerings or replace the lowering function, which a forked child's calls would escape, and
the two xdist workers already use both cores. ``tests/test_forked.py`` turns forking on.

The ``cpu`` hardware profile (``fxremat/hardware.py``) is pinned: the suite plans against the
rates below, not against a profile this host measures once and caches. Measured at the suite's
start, beside the other worker's compiles, that profile came out with 3.2 GB/s of bandwidth
where the quiet host measures 64-71 GB/s, and with it the time estimates that choose plans:
two no-budget tests then failed on every later run from that cache. Child processes inherit
the folder. ``tests/test_cost.py`` measures a profile in a folder of its own.
"""

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ["FXREMAT_PLAN_CACHE"] = "0"
os.environ["FXREMAT_LOWERING_WORKERS"] = "1"

# This host class quiet (2-vCPU AMD EPYC, torch 2.13.0+cpu, 2 threads): the median of three
# measurements by ``hardware.measure_cpu`` on an idle host.
PINNED_CPU_PROFILE = {
    "peak_flops": 210.75e9,
    "attention_flops": 164.87e9,
    "bandwidth": 66.26e9,
    "launch_seconds": 4.3e-6,
    "view_seconds": 2.79e-6,
    "fresh_bandwidth": 3.08e9,
}


def _pin_cpu_profile() -> None:
    """Point ``FXREMAT_CACHE_DIR`` at a folder holding ``PINNED_CPU_PROFILE`` for every thread count."""
    from fxremat import hardware

    folder = Path(tempfile.mkdtemp(prefix="fxremat-suite-profile-"))
    atexit.register(shutil.rmtree, folder, True)
    os.environ["FXREMAT_CACHE_DIR"] = str(folder)
    for threads in range(1, max(2, os.cpu_count() or 1) + 1):
        name = f"cpu-v{hardware.CACHE_VERSION}-{torch.__version__}-{threads}.json"
        (folder / name).write_text(json.dumps(PINNED_CPU_PROFILE))
    assert hardware.measure_cpu() == PINNED_CPU_PROFILE  # read back: the suite never measures its own


_pin_cpu_profile()


@pytest.fixture(autouse=True)
def _programs_lowered_afresh():
    """Each test lowers its own programs (``inductor_memory.program_events`` keeps them per process):
    tests count lowerings, replace the lowering, or compare it with another."""
    from fxremat.passes.inductor_memory import forget_programs

    forget_programs()
    yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` (``make test``): the ``xdist_group`` of a test ends its node id, as xdist does.

    xdist 3.8's workers append ``@group`` to ``item._nodeid``, which pytest 9.2 no longer reads (the
    node id is ``item._id``): no test had a group, and the tests of one group, which share one compile
    in one process (``tests/inductor_watch.py``), ran on both workers and compiled on each. Here,
    after xdist's own hook, a grouped test whose id does not end with its group gets it.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        suffix = f"@{'_'.join(names)}"
        if names and not item.nodeid.endswith(suffix):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)
