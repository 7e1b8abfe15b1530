"""Silence C++ chatter on stderr (the profiler's "USDT ... profiler_start" lines)."""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["quiet_stderr"]


@contextlib.contextmanager
def quiet_stderr():
    """Send file descriptor 2 to /dev/null for the block (Python's sys.stderr is flushed first).

    Used around fxremat's own profiler sessions, whose native logging would
    otherwise print two lines per session into the user's terminal.
    """
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (e.g. captured): nothing to silence
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)
