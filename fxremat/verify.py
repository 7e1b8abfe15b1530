"""The opt-in self-check (``options={"verify": True}`` or ``FXREMAT_VERIFY=1``).

On the first call of a compiled graph, run the planned program and PyTorch's
own partition of the same graph (same inner compiler) on copies of the same
inputs, under the same RNG state, and compare their outputs and the gradients
of every input that requires one. A difference raises ``VerificationError``
naming the first differing gradient, before the real step runs. The real step
then runs as if the check had not happened (same RNG state, untouched inputs).

Cost: one more compile of the graph (PyTorch's partition), and on the first
call two extra forward and backward passes with a copy of the inputs
(parameters included) alive meanwhile. Later calls cost nothing.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Sequence

import torch

__all__ = ["VerificationError", "verified", "input_names", "TOLERANCE"]

log = logging.getLogger(__name__)

# Largest relative difference ||a - b|| / ||b|| accepted per tensor. The two programs
# differ in fusion and reduction order, not in math: fp32 agrees to ~1e-6 relative,
# bf16/fp16 to a few 1e-3; a wrong plan differs by O(1) (T5's wrong gradient: 1.0).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}
# Gradients smaller than this share of the largest gradient norm are compared against that
# share instead of their own norm (their true value may be zero: a relative error means nothing).
FLOOR = 1e-6


class VerificationError(RuntimeError):
    """The planned program's outputs or gradients differ from PyTorch's partition of the same graph.

    Raised on a graph's first call when ``options={"verify": True}`` (or
    ``FXREMAT_VERIFY=1``), before the real step runs. The message names the
    first differing gradient (a parameter's dotted name, or ``input i``) and
    its relative error. It means a bug in fxremat: compile without
    ``backend="fxremat"`` until it is fixed.

    Example:
        >>> compiled = torch.compile(model, backend="fxremat", options={"verify": True})
        >>> compiled(x).sum().backward()   # raises VerificationError if a gradient differs
    """


def input_names(gm: torch.fx.GraphModule) -> list[str]:
    """A readable name per graph input: ``layers.0.weight`` for parameters, ``input 0`` for arguments."""
    names = []
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
        names.append(_clean(source) if isinstance(source, str) else node.name or f"input {i}")
    return names


def _clean(source: str) -> str:
    # Dynamo's sources: L['self']._modules['fc1']._parameters['weight'], L['args'][0], L['x'].
    path = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", source)
    path = re.sub(r"^L\['(?:self|fn|mod|model)'\]\.", "", path)
    return re.sub(r"^L\['([^']+)'\]", r"\1", path)


def verified(compiled: Callable, reference: Callable, names: Sequence[str], where: str) -> Callable:
    """``compiled``, checked against ``reference`` on its first call.

    Args:
        compiled: the planned program, as the backend returns it to Dynamo.
        reference: the same graph compiled with PyTorch's partition.
        names: a name per input, for the error message.
        where: the graph, for messages (``"graph 3"``).

    Returns:
        A callable Dynamo calls in place of ``compiled``.

    Example:
        >>> torch.compile(model, backend="fxremat", options={"verify": True})(x).sum().backward()
    """
    checked = False

    def run(*args):
        # Dynamo calls a backend's callable with the graph's inputs as positional arguments.
        nonlocal checked
        if not checked:
            checked = True
            _check(compiled, reference, list(args), names, where)
        return compiled(*args)

    return run


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _one_step(fn: Callable, args: list, state):
    """Run ``fn`` on copies of ``args``; return its outputs and the gradients of the inputs that need one."""
    _set_rng_state(state)
    copies = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    with torch.enable_grad():
        out = fn(*copies)
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
        wanted = [i for i, c in enumerate(copies) if isinstance(c, torch.Tensor) and c.requires_grad]
        differentiable = [o for o in outs if o.requires_grad]
        grads: dict[int, torch.Tensor | None] = {}
        if wanted and differentiable and torch.is_grad_enabled():
            # Fixed random weights on every output: a wrong value scaled by one could hide.
            gen = torch.Generator().manual_seed(0)
            weights = [
                (torch.rand(o.shape, generator=gen, dtype=torch.float32) + 0.5).to(o.device, o.dtype)
                for o in differentiable
            ]
            got = torch.autograd.grad(differentiable, [copies[i] for i in wanted], weights, allow_unused=True)
            grads = dict(zip(wanted, got))
    return [o.detach() for o in outs], grads


def _error(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), floor, 1e-30))


def _check(compiled, reference, args: list, names: Sequence[str], where: str) -> None:
    state = _rng_state()
    try:
        outs, grads = _one_step(compiled, args, state)
        ref_outs, ref_grads = _one_step(reference, args, state)
    finally:
        _set_rng_state(state)
    for k, (a, b) in enumerate(zip(outs, ref_outs)):
        if a.is_floating_point() and a.shape == b.shape:
            err = _error(a, b, 0.0)
            if err > TOLERANCE.get(b.dtype, 1e-3):
                raise VerificationError(
                    f"fxremat verify, {where}: output {k} differs from PyTorch's partition of the same graph "
                    f"(relative error {err:.3g}). This is a bug in fxremat; please report it, and compile without "
                    "backend='fxremat' meanwhile."
                )
    largest = max((float(g.double().norm()) for g in ref_grads.values() if g is not None), default=0.0)
    for i in sorted(ref_grads):
        a, b = grads.get(i), ref_grads[i]
        if a is None and b is None:
            continue
        if a is None or b is None:
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
        err = _error(a, b, FLOOR * largest)
        if err > TOLERANCE.get(b.dtype, 1e-3):
            name = names[i] if i < len(names) else f"input {i}"
            raise VerificationError(
                f"fxremat verify, {where}: the gradient of {name} differs from PyTorch's partition of the same graph "
                f"(relative error {err:.3g}, tolerance {TOLERANCE.get(b.dtype, 1e-3):g}). This is a bug in fxremat; "
                "please report it, and compile without backend='fxremat' meanwhile."
            )
    log.info("fxremat verify, %s: outputs and %d gradients equal PyTorch's partition", where, len(ref_grads))
