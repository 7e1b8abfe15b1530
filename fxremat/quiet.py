"""Silence native libraries that print past Python (profiler USDT lines, HiGHS progress)."""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["quiet_stderr", "quiet_stdout"]


def quiet_stderr():
    """Silence file descriptor 2 for a block: the profiler's native "USDT" lines."""
    return _quiet(sys.stderr)


def quiet_stdout():
    """Silence file descriptor 1 for a block: HiGHS's native progress prints."""
    return _quiet(sys.stdout)


@contextlib.contextmanager
def _quiet(stream):
    """Send ``stream``'s file descriptor to /dev/null for the block (the stream is flushed first).

    Native libraries write to the descriptor directly, past Python's streams.
    Pure Python, no torch: the solvers use it too.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # no real descriptor (e.g. captured): nothing to silence
        yield
        return
    stream.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)
