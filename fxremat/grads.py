"""Parameter gradients added into ``.grad`` as the backward makes them.

A compiled backward returns every parameter's gradient at its end, and autograd
then adds each into ``.grad``: until then all of them are alive at once. When
``.grad`` already exists (gradient accumulation over micro-batches,
``zero_grad(set_to_none=False)``), eager PyTorch adds each gradient in as soon as
it is made and frees it; on timm's resnet18 (batch 2, 64 px) that is 21.4 MiB
against the compiled step's 45.0 MiB, 42.7 MiB of which are the gradients.

So each compiled backward has a second version (``passes/hand_over.py``) that
passes every parameter's gradient, right after its last use, to the
``fxremat::hand_over`` op, which adds it into that parameter's ``.grad``; the
gradient is then freed, and the backward returns None for it (autograd's
AccumulateGrad has nothing left to do). Each backward runs that version only
when it does exactly what autograd would have done: every such parameter is a
leaf whose AccumulateGrad this backward runs, with ``.grad`` allocated (same
shape, dtype and device), no Python hooks on it, the backward does not keep its
graph (``retain_graph``, ``create_graph``), and ``torch.distributed`` is not
initialised (DDP and other libraries hook AccumulateGrad nodes in ways Python
cannot see). Otherwise the usual version runs: ``torch.autograd.grad``,
``backward(inputs=...)`` leaving some parameters out, and a first step (no
``.grad`` yet; no memory to save, as the gradients become ``.grad``) all get
the gradients at the end as before.

The second version is compiled the first time a backward can use it (Inductor:
one more compile of the backward, in the second step of a loop that keeps
``.grad``). ``Options.hand_over_grads=False`` never builds it.
"""

from __future__ import annotations

import copy
import logging
import threading
import warnings
from typing import Callable

import torch
import torch.fx as fx

from ._torch_compat import (
    backward_keeps_graph,
    compile_context_now,
    current_autograd_node,
    engine_runs_node,
    has_grad_hooks,
)
from .passes.hand_over import HAND_OVER_SPEC, hand_over_gradients

__all__ = ["HAND_OVER_OP", "HandingOver", "handing_over", "on_hand_over"]

log = logging.getLogger("fxremat")

_LIBRARY = torch.library.Library("fxremat", "DEF")
_LIBRARY.define("hand_over(Tensor gradient, int index, int inputs) -> Tensor")

_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"

_LOCAL = threading.local()


_LISTENERS: list[Callable[[object, bool], None]] = []


def on_hand_over(listener: Callable[[object, bool], None]) -> None:
    """Call ``listener(node, handed)`` each time a backward that can hand its gradients over runs:
    ``handed`` says whether it adds them into ``.grad`` as it makes them (else it returns them at
    its end); ``node`` is the autograd node running it (``fxremat/steps.py`` matches it to the call
    that made it). Called before a backward that returns its gradients runs, after one that hands
    them over."""
    _LISTENERS.append(listener)


def _tell(handed: bool) -> None:
    if _LISTENERS:
        node = current_autograd_node()
        for listener in _LISTENERS:
            listener(node, handed)


def _running() -> list[dict[int, torch.Tensor]]:
    """The ``.grad`` tensors of the backwards running on this thread, innermost last."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def _hand_over(gradient: torch.Tensor, index: int, inputs: int) -> torch.Tensor:
    running = _running()
    grads = running[-1] if running else None
    if grads is None or index not in grads:
        raise RuntimeError(
            "fxremat: a parameter gradient reached fxremat::hand_over outside the backward that checked its "
            "parameter (a backward run by compiled autograd?); it cannot be delivered. Compile with "
            "options={'hand_over_grads': False} to return every gradient at the end of the backward."
        )
    # No ``torch.no_grad()`` (2 us of the 9 us a hand-over costs): ``existing_grads`` hands over only in a
    # backward that does not keep its graph, so not ``create_graph``, and the engine runs it without grad.
    grads[index].add_(gradient)
    return gradient.new_empty(0)


_LIBRARY.impl("hand_over", _hand_over, "CompositeExplicitAutograd")
_LIBRARY.impl("hand_over", lambda gradient, index, inputs: gradient.new_empty(0), "Meta")

HAND_OVER_OP = torch.ops.fxremat.hand_over.default
"""``hand_over(gradient, index, inputs)``: add ``gradient`` into the ``.grad`` of the graph's input
``index`` (of ``inputs``) and return an empty tensor (``passes/hand_over.py`` places it)."""


def existing_grads(indices: tuple[int, ...], edges: tuple[int, ...]) -> dict[int, torch.Tensor] | None:
    """The ``.grad`` of each parameter at ``indices``, when the running backward may add into all of them
    what autograd's AccumulateGrad would; else None (the gradients go back to autograd).

    ``edges[i]`` is input ``i``'s position among the autograd node's edges (-1: a size, which has none).
    """
    node = current_autograd_node()
    if node is None or backward_keeps_graph():
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    next_functions = node.next_functions
    if len(next_functions) != sum(1 for e in edges if e >= 0):
        return None  # not the node of the graph these positions were planned for
    grads = {}
    for i in indices:
        if edges[i] < 0:
            return None
        acc = next_functions[edges[i]][0]
        if acc is None or acc.name() != _ACCUMULATE_GRAD or not engine_runs_node(acc):
            return None
        param = acc.variable
        grad = param.grad
        if grad is None or has_grad_hooks(param) or grad.layout != torch.strided:
            return None
        if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
            return None
        grads[i] = grad
    return grads


class HandingOver:
    """A compiled backward, and the version of it that adds the parameters' gradients into ``.grad``
    as it makes them, run when ``existing_grads`` allows (boxed convention: ``backward(args)``)."""

    def __init__(
        self, returning: Callable, build: Callable[[], Callable], indices: tuple[int, ...], edges: tuple[int, ...]
    ):
        # An instance attribute: the wrappers AOTAutograd puts around a backward copy the instance's __dict__.
        self._boxed_call = True
        self.returning = returning
        self.build = build
        self.indices = indices
        self.edges = edges
        """Each graph input's position among the autograd node's edges (-1: a size)."""
        self.accumulating: Callable | None = None
        self.failed = False

    def __call__(self, args):
        grads = None if self.failed else existing_grads(self.indices, self.edges)
        if grads is None:
            _tell(False)
            return self.returning(args)
        program = self.accumulating
        if program is None:
            try:
                program = self.accumulating = self.build()
            except Exception as e:  # noqa: BLE001 - the usual backward is still right: run it, loudly
                self.failed = True
                warnings.warn(
                    f"fxremat: compiling the backward that adds gradients into .grad as it makes them failed "
                    f"({type(e).__name__}: {e}); this graph returns its gradients at the end instead",
                    stacklevel=2,
                )
                _tell(False)
                return self.returning(args)
        running = _running()
        running.append(grads)
        try:
            out = list(program(args))
        finally:
            running.pop()
        for i in self.indices:
            out[i] = None
        _tell(True)
        return out


def handing_over(compile_program: Callable) -> Callable:
    """``compile_program`` (an inner compiler of planned forward and backward programs), whose
    backwards also get the version that adds parameter gradients into ``.grad`` as it makes them.

    A backward the planner marked (``HAND_OVER_SPEC``) is compiled as it is, and its
    other version is compiled, under the same contexts and settings, the first time a
    backward can use it. Other programs are compiled as they are.
    """

    def compile_with(gm: fx.GraphModule, example_inputs, **kwargs):
        spec = gm.meta.get(HAND_OVER_SPEC)
        if spec is None:
            return compile_program(gm, example_inputs, **kwargs)
        variant = copy.deepcopy(gm)
        indices = hand_over_gradients(variant, list(spec[0]), spec[1], HAND_OVER_OP)
        if not indices:
            return compile_program(gm, example_inputs, **kwargs)
        inputs = list(example_inputs)
        again = compile_context_now()

        def build() -> Callable:
            log.info("fxremat: compiling the backward that adds %d gradients into .grad as it makes them", len(indices))
            with again():
                return compile_program(variant, inputs, **kwargs)

        compiled = compile_program(gm, example_inputs, **kwargs)
        if not getattr(compiled, "_boxed_call", False):
            return compiled  # every inner compiler fxremat uses is boxed; another keeps its gradients
        return HandingOver(compiled, build, indices, spec[2])

    return compile_with
