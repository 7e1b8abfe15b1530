"""Shared assertions: a compiled training step equals the eager one."""

from __future__ import annotations

import torch

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
