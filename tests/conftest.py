"""Suite-wide settings.

The plan cache (``fxremat/plan_cache.py``) is off: a test that plans a model the
same way as an earlier test must plan it, not read the earlier plan (many tests
count solver runs and lowerings, or time them). ``tests/test_plan_cache.py``
turns it on in its own folder. Child processes inherit the setting.

Dry lowerings stay in the test's process (``FXREMAT_LOWERING_WORKERS=1``): tests count
lowerings or replace the lowering function, which a forked child's calls would escape, and
the two xdist workers already use both cores. ``tests/test_forked.py`` turns forking on.
"""

import os

import pytest

os.environ["FXREMAT_PLAN_CACHE"] = "0"
os.environ["FXREMAT_LOWERING_WORKERS"] = "1"


@pytest.fixture(autouse=True)
def _programs_lowered_afresh():
    """Each test lowers its own programs (``inductor_memory.program_events`` keeps them per process):
    tests count lowerings, replace the lowering, or compare it with another."""
    from fxremat.passes.inductor_memory import forget_programs

    forget_programs()
    yield
