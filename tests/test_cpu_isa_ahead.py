"""Inductor's check of the CPU's vector instruction sets runs in a thread while the graph is traced and
planned (``_torch_compat.check_cpu_isa_ahead``), once per process; lowerings and forks wait for it."""

from __future__ import annotations

import functools
import threading
import time

import torch

import fxremat
from fxremat import _torch_compat
from fxremat.backend import checking_cpu_ahead
from fxremat.passes import inductor_memory


def _slow_check(monkeypatch) -> list[str]:
    """``valid_vec_isa_list`` replaced by a cached one that takes 0.3 s; the threads it ran on."""
    from torch._inductor import cpu_vec_isa

    ran: list[str] = []

    @functools.cache
    def valid_vec_isa_list():
        ran.append(threading.current_thread().name)
        time.sleep(0.3)
        return []

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    monkeypatch.setattr(_torch_compat, "_CPU_ISA_CHECK", [])
    return ran


def test_the_check_runs_once_in_a_thread_and_is_waited_for(monkeypatch):
    ran = _slow_check(monkeypatch)
    started = time.perf_counter()
    _torch_compat.check_cpu_isa_ahead()
    _torch_compat.check_cpu_isa_ahead()  # already started: not again
    assert time.perf_counter() - started < 0.2  # it did not wait
    _torch_compat.cpu_isa_checked()
    assert ran == ["fxremat-cpu-isa-check"]
    _torch_compat.check_cpu_isa_ahead()
    _torch_compat.cpu_isa_checked()
    assert len(ran) == 1


def test_a_step_on_the_cpu_under_inductor_starts_it_and_an_eager_one_does_not(monkeypatch):
    ran = _slow_check(monkeypatch)
    x = torch.randn(4, 4)
    checking_cpu_ahead(fxremat.Options(inner="eager"), [x])
    assert not _torch_compat._CPU_ISA_CHECK
    checking_cpu_ahead(fxremat.Options(), [torch.empty(4, 4, device="meta"), x, 3])
    _torch_compat.cpu_isa_checked()
    assert ran == ["fxremat-cpu-isa-check"]


def test_children_that_lower_are_forked_after_the_check(monkeypatch):
    """Forked after it, a child inherits its answer instead of checking again."""
    _slow_check(monkeypatch)
    order: list[str] = []
    monkeypatch.setattr(inductor_memory, "cpu_isa_checked", lambda: order.append("checked"))
    monkeypatch.setattr(inductor_memory, "workers", lambda: 2)
    monkeypatch.setattr(inductor_memory, "fork_call", lambda call, what: order.append("fork") or _NoChild())
    from torch.fx.experimental.proxy_tensor import make_fx

    programs = [
        (make_fx(lambda a: (a.sin() * 2).cos(), tracing_mode="fake")(torch.randn(2, n)), False, None, None)
        for n in (3, 4)
    ]
    handed = inductor_memory.start_lowering(programs, here=False)
    try:
        assert order == ["checked", "fork"], order
    finally:
        for key in handed:
            inductor_memory._PENDING.pop(key, None)


class _NoChild:
    def answered(self) -> bool:
        return False

    def cancel(self) -> None:
        pass
