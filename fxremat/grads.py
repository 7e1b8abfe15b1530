"""Parameter gradients added into ``.grad`` as the backward makes them.

A compiled backward returns every parameter's gradient at its end, and autograd
then adds each into ``.grad``: until then all of them are alive at once. When
``.grad`` already exists (gradient accumulation over micro-batches,
``zero_grad(set_to_none=False)``), eager PyTorch adds each gradient in as soon as
it is made and frees it; on timm's resnet18 (batch 2, 64 px) that is 21.4 MiB
against the compiled step's 45.0 MiB, 42.7 MiB of which are the gradients.

So each compiled backward has a second version (``passes/hand_over.py``) that
takes those parameters' ``.grad`` as extra inputs and adds every gradient into
its ``.grad`` in place right after its last use, in the program itself (Inductor
fuses the add into a kernel); the gradient is then freed, and the backward
returns None for it (autograd's AccumulateGrad has nothing left to do). Each
backward runs that version only
when it does exactly what autograd would have done: every such parameter is a
leaf whose AccumulateGrad this backward runs, with ``.grad`` allocated (same
shape, dtype and device, and the strides the version was compiled for), no
Python hooks on it, the backward does not keep its
graph (``retain_graph``, ``create_graph``), and ``torch.distributed`` is not
initialised (DDP and other libraries hook AccumulateGrad nodes in ways Python
cannot see). Otherwise the usual version runs: ``torch.autograd.grad``,
``backward(inputs=...)`` leaving some parameters out, and a first step (no
``.grad`` yet; no memory to save, as the gradients become ``.grad``) all get
the gradients at the end as before.

The second version is compiled the first time a backward can use it (Inductor:
one more compile of the backward, in the second step of a loop that keeps
``.grad``), for the strides its ``.grad`` tensors have then. ``Options.hand_over_grads=False`` never builds it.
"""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
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
from .passes.hand_over import HAND_OVER_SPEC, grad_inputs, hand_over_gradients

__all__ = ["HandingOver", "handing_over", "on_hand_over"]

log = logging.getLogger("fxremat")

_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"

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


def existing_grads(
    positions: tuple[int, ...], edge_count: int, checked: list[tuple | None]
) -> list[torch.Tensor] | None:
    """The ``.grad`` of each parameter whose AccumulateGrad is the running autograd node's edge at
    ``positions``, in that order, when the running backward may add into all of them what autograd's
    AccumulateGrad would; else None (the gradients go back to autograd).

    ``edge_count``: how many edges the node planned for has. ``checked``: the caller's memory of
    earlier calls, one entry per position (updated here), by weak reference. A ``.grad`` tensor
    checked before is not checked again for its layout and shape (changed in place only by
    ``resize_``/``set_``; ``HandingOver`` compares its strides at every call, and Inductor's program
    asserts sizes and strides); whether the engine runs the parameter's AccumulateGrad, its hooks,
    which tensor is ``.grad``, its dtype and device are checked at every call.
    """
    node = current_autograd_node()
    if node is None or backward_keeps_graph():
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    next_functions = node.next_functions
    if len(next_functions) != edge_count:
        return None  # not the node of the graph these positions were planned for
    grads = []
    for k, at in enumerate(positions):
        acc = next_functions[at][0]
        if acc is None:
            return None
        param = getattr(acc, "variable", None)  # only an AccumulateGrad has one
        if param is None:
            return None
        known = checked[k]
        if known is None or known[0]() is not param:
            if acc.name() != _ACCUMULATE_GRAD:
                return None
            known = None
        if not engine_runs_node(acc):
            return None
        grad = param.grad
        if grad is None or has_grad_hooks(param):
            return None
        if known is None or known[1]() is not grad or grad.dtype is not known[2] or grad.device != known[3]:
            if grad.layout != torch.strided:
                return None
            if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
                return None
            checked[k] = (weakref.ref(param), weakref.ref(grad), grad.dtype, grad.device)
        grads.append(grad)
    return grads


class HandingOver:
    """A compiled backward, and the version of it that adds the parameters' gradients into ``.grad``
    as it makes them, run when ``existing_grads`` allows (boxed convention: ``backward(args)``)."""

    def __init__(
        self,
        returning: Callable,
        build: Callable[[list[torch.Tensor]], Callable],
        indices: tuple[int, ...],
        edges: tuple[int, ...],
    ):
        # An instance attribute: the wrappers AOTAutograd puts around a backward copy the instance's __dict__.
        self._boxed_call = True
        self.returning = returning
        self.build = build
        # Each handed parameter's position among the autograd node's edges (``edges``: each graph
        # input's, -1 for a size, which has none); None when one has none.
        self.positions: tuple[int, ...] | None = (
            tuple(edges[i] for i in indices) if all(edges[i] >= 0 for i in indices) else None
        )
        self.edge_count = sum(1 for e in edges if e >= 0)
        self.accumulating: Callable | None = None
        self.checked: list[tuple | None] = [None] * len(indices)
        """``existing_grads``' memory of the parameters and ``.grad`` it checked."""
        self.strides: tuple[tuple[int, ...], ...] = ()
        """The ``.grad`` strides ``accumulating`` was compiled for (Inductor specialises on them)."""
        self.failed = False

    def __call__(self, args):
        given = None
        if not self.failed and self.positions is not None:
            given = existing_grads(self.positions, self.edge_count, self.checked)
        if given is None:
            _tell(False)
            return self.returning(args)
        program = self.accumulating
        if program is None:
            try:
                program = self.accumulating = self.build(given)
            except Exception as e:  # noqa: BLE001 - the usual backward is still right: run it, loudly
                self.failed = True
                warnings.warn(
                    f"fxremat: compiling the backward that adds gradients into .grad as it makes them failed "
                    f"({type(e).__name__}: {e}); this graph returns its gradients at the end instead",
                    stacklevel=2,
                )
                _tell(False)
                return self.returning(args)
            self.strides = tuple(g.stride() for g in given)
        elif any(g.stride() != s for g, s in zip(given, self.strides)):
            # ``.grad`` laid out anew since (set by the user at other strides): autograd adds them in.
            _tell(False)
            return self.returning(args)
        args.extend(given)  # boxed: the program frees the saved values as it goes, as the usual one does
        out = program(args)
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
        indices = hand_over_gradients(variant, list(spec[0]))
        if not indices:
            return compile_program(gm, example_inputs, **kwargs)
        inputs = list(example_inputs)
        again = compile_context_now()

        def build(grads: list[torch.Tensor]) -> Callable:
            log.info("fxremat: compiling the backward that adds %d gradients into .grad as it makes them", len(indices))
            # Each ``.grad`` input as the program will get it: Inductor compiles for its strides.
            given = []
            for node, grad in zip(grad_inputs(variant), grads):
                node.meta["val"] = node.meta["val"].new_empty_strided(grad.shape, grad.stride())
                given.append(node.meta["val"])
            with again():
                return compile_program(variant, inputs + given, **kwargs)

        compiled = compile_program(gm, example_inputs, **kwargs)
        if not getattr(compiled, "_boxed_call", False):
            return compiled  # every inner compiler fxremat uses is boxed; another keeps its gradients
        return HandingOver(compiled, build, indices, spec[1])

    return compile_with
