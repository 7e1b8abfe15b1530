"""The cost pass: FLOPs equal torch.utils.flop_counter's, bytes are per storage."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fxremat.passes.cost import HARDWARE, annotate, get_hardware



def _joint_costs(fn, *args):
    """Cost table of fn's forward graph traced by make_fx, and flop_counter's count of the same call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*args)
    costs = annotate(gm, get_hardware("a100"))
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return gm, costs, counter.get_total_flops()


def test_matmul_conv_flops_match_flop_counter():
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    _, costs, expected = _joint_costs(torch.mm, a, b)
    assert sum(c.flops for n, c in costs.items() if "mm" in c.op) == expected == 2 * 64 * 128 * 32

    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    _, costs, expected = _joint_costs(lambda x, w: F.conv2d(x, w, padding=1), x, w)
    assert sum(c.flops for c in costs.values() if "convolution" in c.op) == expected


def test_sdpa_flops_match_the_attention_formula():
    q = torch.randn(2, 4, 64, 32)
    gm, costs, _ = _joint_costs(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, q, q)
    attn = [c for c in costs.values() if "scaled_dot_product" in c.op]
    assert attn, [c.op for c in costs.values()]
    # Two batched matmuls of 2*b*h*s*s*d each: the formula flop_counter uses for the CUDA kernels.
    assert attn[0].flops == 4 * 2 * 4 * 64 * 64 * 32


def test_views_and_inplace_own_no_storage():
    def fn(x):
        y = x * 2
        z = y.view(-1).t() if y.dim() == 1 else y.view(-1)
        y.add_(1)
        return z.sum() + y.sum()

    gm, costs, _ = _joint_costs(fn, torch.randn(8, 8))
    by_op = {c.op: c for c in costs.values()}
    assert by_op["aten.mul"].nbytes == 8 * 8 * 4
    assert by_op["aten.view"].nbytes == 0


def test_cpu_profile_is_measured_and_gpu_profiles_are_datasheets():
    cpu = get_hardware("cpu")
    assert cpu.peak_flops > 1e8 and cpu.bandwidth > 1e8 and 0 < cpu.launch_seconds < 1e-3
    assert get_hardware("h100").peak_flops == 989e12
    assert set(HARDWARE) == {"cpu", "a100", "h100", "h200"}
