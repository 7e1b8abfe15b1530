"""Shared assertions: a compiled training step equals the eager one."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

ATOL = 1e-5
RTOL = 1e-4


def state(model):
    """Cloned gradients (of parameters that have one) and buffers, by name."""
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return grads, buffers


def compare(ref_model, ref_loss, model, loss, atol=ATOL, rtol=RTOL):
    """Loss, every gradient and every buffer of ``model`` equal ``ref_model``'s."""
    torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=rtol)
    ref_grads, ref_buffers = state(ref_model)
    grads, buffers = state(model)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=atol, rtol=rtol, msg=f"gradient of {name}")
    assert buffers.keys() == ref_buffers.keys()
    for name in ref_buffers:
        torch.testing.assert_close(buffers[name], ref_buffers[name], atol=atol, rtol=rtol, msg=f"buffer {name}")


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module, loaded by path under its own name (``tests/zoo.py``
    is the module ``zoo`` of the tests, so the benchmark cannot be imported as ``zoo``)."""
    spec = importlib.util.spec_from_file_location(f"fxremat_benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def child_env(drop: tuple[str, ...], **extra: str) -> dict[str, str]:
    """This process's environment for a child, less the variables whose names start with one of
    ``drop``, plus ``extra``. ``FXREMAT_CACHE_DIR`` always stays: it holds the suite's pinned cpu
    profile (conftest.py), without which a child measures one of its own beside the suite's load."""
    keep = {"FXREMAT_CACHE_DIR"}
    env = {k: v for k, v in os.environ.items() if k in keep or not k.startswith(drop)}
    env.update(extra)
    return env
