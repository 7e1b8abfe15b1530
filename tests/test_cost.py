"""The cost pass: FLOPs equal torch.utils.flop_counter's, bytes are per storage."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fxremat.hardware import HARDWARE, get_hardware
from fxremat.passes.cost import annotate


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


def test_grouped_matmuls_count_every_product_and_the_fallback_one_launch_per_expert():
    """transformers' expert matmul (one ``mm`` per expert in a Python loop) and its backward: FLOPs of the
    products, not one per element read (HF Mixtral's experts were priced 20x too cheap and recomputed)."""
    pytest.importorskip("transformers.integrations.moe")
    S, K, N, E = 48, 32, 64, 4
    x, w = torch.randn(S, K), torch.randn(E, K, N)
    offs = torch.tensor([10, 20, 40, 48])
    hw = get_hardware("a100")

    def forward(x, w, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, w, offs)

    gm, costs, _ = _joint_costs(forward, x, w, offs)
    (mm,) = [c for c in costs.values() if c.op == "transformers.grouped_mm_fallback"]
    assert mm.flops == 2 * S * K * N
    assert mm.seconds >= E * hw.launch_seconds

    def backward(x, w, offs, g):
        return torch.ops.transformers.grouped_mm_fallback_backward(x, w, offs, g)

    _, costs, _ = _joint_costs(backward, x, w, offs, torch.randn(S, N))
    (bw,) = [c for c in costs.values() if c.op == "transformers.grouped_mm_fallback_backward"]
    assert bw.flops == 4 * S * K * N
    assert bw.seconds >= 2 * E * hw.launch_seconds


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


def test_split_outputs_are_views_of_the_input():
    def fn(x):
        a, b, c = (x * 2).split(4, dim=-1)
        return a * b + c

    gm, costs, _ = _joint_costs(fn, torch.randn(8, 12))
    by_name = {n.name: (n, c) for n, c in costs.items()}
    mul = by_name["mul"][0]
    for name in ("getitem", "getitem_1", "getitem_2"):
        assert by_name[name][1].owner is mul and by_name[name][1].nbytes == 0
    assert by_name["split"][1].bytes_moved == 0


def test_cpu_profile_fields_and_versioned_cache(tmp_path, monkeypatch):
    from fxremat import hardware

    monkeypatch.setenv("FXREMAT_CACHE_DIR", str(tmp_path))
    assert f"v{hardware.CACHE_VERSION}" in hardware.cache_path().name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread cannot stall on another: the profile is cached under any load
    try:
        cpu = get_hardware("cpu")  # measured now (empty cache folder), then cached
        assert hardware.cache_path().exists()
        assert cpu.attention_flops > 1e8 and 0 < cpu.view_seconds < 1e-3 and cpu.fresh_bandwidth > 1e7
        assert get_hardware("cpu") == cpu  # from the cache
    finally:
        torch.set_num_threads(threads)
    assert get_hardware("a100").fresh_bandwidth == float("inf") and get_hardware("a100").view_seconds == 0


def test_large_fresh_outputs_pay_page_faults():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxremat.hardware import FRESH_OUTPUT_BYTES, Hardware

    hw = Hardware("test", peak_flops=1e12, bandwidth=1e11, launch_seconds=0.0, fresh_bandwidth=1e9)
    n = FRESH_OUTPUT_BYTES // 4
    gm = make_fx(lambda x: x + 1, tracing_mode="fake")(torch.empty(n))
    (add,) = [c for c in annotate(gm, hw).values() if c.op == "aten.add"]
    assert add.seconds == pytest.approx(8 * n / 1e11 + 4 * n / 1e9)


# ---------------------------------------------------------------- calibration


def _mlp(x, w1, w2):
    h = torch.relu(x @ w1)
    h = F.dropout(h, p=0.5, training=True)
    return (h @ w2).sum()


def test_calibrate_times_mm_nodes_and_skips_random_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxremat.passes.calibrate import calibrate_costs

    args = (torch.randn(64, 32), torch.randn(32, 48), torch.randn(48, 16))
    gm = make_fx(_mlp, tracing_mode="fake")(*args)
    costs = annotate(gm, get_hardware("a100"))  # a roofline far from this host's times
    before = torch.random.get_rng_state()
    calibrated = calibrate_costs(gm, costs)
    assert torch.equal(torch.random.get_rng_state(), before)  # the user's RNG did not move
    mms = [n for n, c in calibrated.items() if c.op == "aten.mm"]
    assert len(mms) == 2
    for node in mms:
        c = calibrated[node]
        assert c.timed and 1e-7 < c.seconds < 1.0 and c.seconds != costs[node].seconds
        assert (c.nbytes, c.flops, c.bytes_moved) == (costs[node].nbytes, costs[node].flops, costs[node].bytes_moved)
    # make_fx traces dropout as an in-place random bernoulli_ and an in-place div_: neither runs.
    skipped = [n for n, c in calibrated.items() if c.op in ("aten.bernoulli_", "aten.div_")]
    assert len(skipped) == 2 and all(not calibrated[n].timed and calibrated[n] == costs[n] for n in skipped)
    assert not any(c.timed for n, c in calibrated.items() if n.op != "call_function")


def test_calibrate_runs_nothing_inside_a_profiler():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxremat.passes.calibrate import calibrate_costs

    gm = make_fx(torch.mm, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    costs = annotate(gm, get_hardware("a100"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        calibrated = calibrate_costs(gm, costs)
    assert calibrated == costs  # fxremat.measure's peak must not see calibration's tensors


def test_calibrate_option_is_validated_and_keyed():
    from fxremat.options import Options

    assert Options.from_mapping({}).calibrate is False
    assert Options.from_mapping({"calibrate": True}).calibrate is True
    assert Options.from_mapping({"calibrate": True}).key() != Options.from_mapping({}).key()
    with pytest.raises(TypeError, match="calibrate"):
        Options.from_mapping({"calibrate": "yes"})


def _train_step(model, x):
    loss = model(x)
    loss.backward()
    return loss.detach()


def test_compile_with_calibrate_matches_eager():
    import copy

    import fxremat
    from checks import compare
    from zoo import Transformer

    torch.manual_seed(0)
    base, x = Transformer(dim=32, layers=2), torch.randn(2, 16, 32)
    ref = copy.deepcopy(base)
    ref_loss = _train_step(ref, x)
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fxremat.backend(inner="eager", calibrate=True))
    compare(ref, ref_loss, model, _train_step(compiled, x))


def test_compile_with_calibrate_uses_measured_seconds(caplog):
    import logging

    import fxremat
    from zoo import Transformer

    torch.manual_seed(0)
    model, x = Transformer(dim=32, layers=1), torch.randn(2, 16, 32)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="fxremat.passes.calibrate"):
        plan = fxremat.explain(model, x, inner="eager", hardware="a100", calibrate=True)
    assert any("calibrated" in r.getMessage() for r in caplog.records)
    roofline = fxremat.explain(model, x, inner="eager", hardware="a100")
    assert plan.problem.seconds != roofline.problem.seconds


# ------------------------------------------------------------ symbolic shapes


def test_dynamic_shapes_keep_symbolic_bytes_and_flops():
    import sympy
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    import fxremat
    from fxremat import planner
    from zoo import Transformer

    torch.manual_seed(0)
    model = Transformer(dim=32, layers=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fxremat.backend(inner="eager", measure_scratch=False), dynamic=True)
    with planner.watch() as planned:
        for n in (8, 12):
            compiled(torch.randn(2, n, 32)).backward()
    assert len(planned) == 1  # one plan for every length: no budget, no size guard
    analysis = planned[0][0]
    joint, costs = analysis.joint, analysis.costs
    hints = {}
    for ph in joint.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("val")
        dims = val.shape if isinstance(val, torch.Tensor) else [val] if isinstance(val, torch.SymInt) else []
        for d in dims:
            if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                hints[d.node.expr] = optimization_hint(d)
    assert hints, "the graph has no symbolic sizes"
    mms = [c for c in costs.values() if c.op in ("aten.mm", "aten.addmm")]
    assert mms and all(c.sym_flops is not None and c.sym_flops.free_symbols for c in mms)
    symbolic = [c for c in costs.values() if c.sym_nbytes is not None]
    for c in symbolic:
        assert int(c.sym_nbytes.subs(hints)) == c.nbytes
        if c.sym_flops is not None:
            assert int(c.sym_flops.subs(hints)) == c.flops
            assert int(c.sym_bytes_moved.subs(hints)) == c.bytes_moved
    # A parameter's size is static: its record has no expression.
    assert any(c.sym_nbytes is None and n.op == "placeholder" for n, c in costs.items())


def _fake_profile(monkeypatch, tmp_path, ratios):
    """measure_cpu in an empty folder, with _measure and the stall check replaced: returns the count of
    measurements taken."""
    from fxremat import hardware

    monkeypatch.setenv("FXREMAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "_UNCACHED", {})
    monkeypatch.setattr(hardware.time, "sleep", lambda s: None)
    ratios = iter(ratios)
    monkeypatch.setattr(hardware, "_stall_ratio", lambda: next(ratios))
    taken = []

    def measure():
        taken.append(1)
        return {field: float(len(taken)) for field in hardware._FIELDS}, next(ratios)

    monkeypatch.setattr(hardware, "_measure", measure)
    return taken


def test_a_profile_measured_while_threads_stall_is_taken_again(tmp_path, monkeypatch, recwarn):
    from fxremat import hardware

    # Stalled before the first try (not measured), stalled inside the second, clean before and inside the third.
    taken = _fake_profile(monkeypatch, tmp_path, [12.0, 0.5, 9.0, 0.5, 0.6])
    data = hardware.measure_cpu()
    assert len(taken) == 2 and data["bandwidth"] == 2.0
    assert json.loads(hardware.cache_path().read_text()) == data
    assert not [w for w in recwarn if "cpu profile" in str(w.message)]


def test_a_profile_that_stays_stalled_warns_once_and_is_not_cached(tmp_path, monkeypatch):
    from fxremat import hardware

    taken = _fake_profile(monkeypatch, tmp_path, [12.0, 12.0, 12.0, 11.0])
    with pytest.warns(UserWarning, match="threads kept waiting for one another.*not cached"):
        data = hardware.measure_cpu()
    assert len(taken) == 1 and not hardware.cache_path().exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hardware.measure_cpu() == data  # this process's profile: not measured or warned again
    assert len(taken) == 1


def test_the_stall_ratio_times_all_threads_against_one():
    from fxremat import hardware

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert hardware._stall_ratio() == 1.0
        torch.set_num_threads(2)
        assert hardware._stall_ratio() > 0
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(threads)
