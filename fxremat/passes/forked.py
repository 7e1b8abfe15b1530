"""Dry lowerings in forked children: a plan's forward and backward lowered at once.

Judging a plan under Inductor lowers its forward and its backward program
(``inductor_memory.program_events``), one after the other, each a few seconds of
single-threaded Python: most of a first compile's planning (docs/BENCHMARKS.md,
"Compile time"). The two are independent, so a forked child can lower one while
this process lowers the other. The child inherits the graphs, their fake tensors
and Inductor's settings as they are at the fork, runs the same lowering and sends
back its events (plain tuples, pickled through a pipe); the events are equal to an
in-process lowering's (``tests/test_forked.py``, and every program of the benchmark
models). What the child computes never changes a plan: a child that fails, exits or
does not answer in time is ended and its program lowered here instead, with one log
line.

A child is forked only where that is safe and can help:

- on Linux (``os.fork``; macOS's system frameworks are not safe to use in a forked
  child, which is why Python spawns there), with at least two CPUs this process may use;
- never once CUDA is initialized in this process (a forked child cannot use it);
- ``FXREMAT_LOWERING_WORKERS`` (an int) caps the processes lowering at once, this one
  included; ``1`` turns forking off.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Child", "workers", "fork_call", "ENV_WORKERS", "MAX_WORKERS", "MIN_WAIT_SECONDS"]

log = logging.getLogger(__name__)

ENV_WORKERS = "FXREMAT_LOWERING_WORKERS"
# A plan has two programs, and with no budget up to four candidate plans are judged at once
# (planner ``_no_budget``): eight programs, four processes lowering them. Capped by the CPUs.
MAX_WORKERS = 4
# A child that has not answered after this long, and after twice as long as it had run when
# this process started waiting for it, is taken to hang (a lock held by another thread at the
# fork) and ended: the slowest single lowering measured here (a 32-layer 8B-shaped backward)
# took under a minute on this 2-core host.
MIN_WAIT_SECONDS = 120.0


def workers() -> int:
    """How many processes may lower programs at once, this one included (1: no child is forked)."""
    raw = os.environ.get(ENV_WORKERS, "").strip()
    if raw:
        try:
            wanted = int(raw)
        except ValueError:
            raise ValueError(
                f"{ENV_WORKERS}={raw!r} is not an int; set it to 1 to lower in this process only, "
                f"or to the number of processes that may lower at once"
            ) from None
        if wanted < 1:
            raise ValueError(f"{ENV_WORKERS}={wanted} must be at least 1 (1 turns forked lowering off)")
    else:
        wanted = MAX_WORKERS
    if not sys.platform.startswith("linux") or not hasattr(os, "fork") or torch.cuda.is_initialized():
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(wanted, cpus))


@dataclass
class Child:
    """A forked child computing one call; ``result`` collects it."""

    pid: int
    fd: int
    started: float
    what: str

    def result(self) -> tuple[bool, object]:
        """(True, the call's return value), or (False, why) when the child failed or did not answer.

        Waits for the child; always reaps it.
        """
        chunks: list[bytes] = []
        waited = time.perf_counter()
        deadline = waited + max(MIN_WAIT_SECONDS, 2 * (waited - self.started))
        try:
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    os.kill(self.pid, signal.SIGKILL)
                    return False, f"no answer after {time.perf_counter() - self.started:.0f} s"
                ready, _, _ = select.select([self.fd], [], [], left)
                if not ready:
                    continue
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            try:
                ok, value = pickle.loads(b"".join(chunks))
            except Exception as e:  # noqa: BLE001 - a child that died mid-write: lowered here instead
                return False, f"its answer could not be read ({type(e).__name__}: {e})"
            return bool(ok), value
        except BaseException:  # interrupted while waiting (Ctrl-C): the child's answer is not wanted
            os.kill(self.pid, signal.SIGKILL)
            raise
        finally:
            os.close(self.fd)
            _reap(self.pid)

    def answered(self) -> bool:
        """The call has returned: its answer is ready to read (``result`` will not wait for the call)."""
        ready, _, _ = select.select([self.fd], [], [], 0)
        return bool(ready)

    def cancel(self) -> None:
        """End the child without reading its answer."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(self.fd)
        _reap(self.pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def fork_call(call: Callable[[], object], what: str) -> Child:
    """Start ``call()`` in a forked child; its (picklable) return value comes back through ``Child.result``.

    The child never returns into the caller's code: it writes its answer and leaves with ``os._exit``
    (no atexit handlers, no flushing of buffers it shares with this process).
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(read_end)
            try:
                answer = pickle.dumps((True, call()))
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which lowers it itself
                answer = pickle.dumps((False, f"{type(e).__name__}: {e}"))
            view = memoryview(answer)
            while view:
                view = view[os.write(write_end, view) :]
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    return Child(pid, read_end, time.perf_counter(), what)
