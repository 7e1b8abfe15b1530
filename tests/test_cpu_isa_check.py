"""Inductor's CPU check (which vector instruction sets its C++ compiler can use): dry lowerings never
ask for it, and the real compile's check runs in a thread beside planning, waited for before the
compile that generates kernels asks."""

from __future__ import annotations

import threading
import time

import torch
import torch.nn as nn
from torch._inductor import cpu_vec_isa

import fxremat
from fxremat import _torch_compat


class _Check:
    """A stand-in for ``cpu_vec_isa.valid_vec_isa_list``: records each call's thread and time, answers
    "no vector set" after ``seconds``, and looks uncached to ``check_cpu_isa_ahead``."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.calls: list[tuple[str, float, float]] = []

    def __call__(self):
        start = time.perf_counter()
        time.sleep(self.seconds)
        self.calls.append((threading.current_thread().name, start, time.perf_counter()))
        return []

    def cache_info(self):
        return type("Info", (), {"currsize": 0})()


def _pointwise_graph() -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(lambda x: (x.sin() * 2).cos(), tracing_mode="fake")(torch.randn(64, 64))


def test_a_dry_lowering_writes_scalar_kernels_without_checking_the_cpu(monkeypatch):
    check = _Check()
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", check)
    events = _torch_compat.inductor_program_events(_pointwise_graph(), is_backward=False)
    assert any(e[0] == "kernel" for e in events)  # a C++ kernel was generated
    assert check.calls == []
    # The vectorized variant, as the real compile writes it, asks.
    _torch_compat.inductor_program_events(_pointwise_graph(), is_backward=False, vectorized=True)
    assert check.calls


def test_the_real_compile_checks_the_cpu_in_a_thread_and_waits_for_it(monkeypatch):
    check = _Check(seconds=0.5)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", check)
    monkeypatch.setattr(_torch_compat, "_CPU_ISA_CHECK", [])
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
    x = torch.randn(16, 32)
    try:
        # Without the FX graph cache the real compile generates its kernels, asking for the check's answer.
        with torch._inductor.config.patch(fx_graph_cache=False):
            torch.compile(model, backend="fxremat")(x).sum().backward()
    finally:
        torch._dynamo.reset()
        fxremat.clear_plans()
    (thread, _, done), *later = check.calls
    assert thread == "fxremat-cpu-isa-check"
    # The compile asked only after the thread answered (joined): never a second check beside it.
    assert later and all(name != "fxremat-cpu-isa-check" and start >= done for name, start, _ in later)
