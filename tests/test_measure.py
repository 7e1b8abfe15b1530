"""fxremat.measure against allocations whose sizes are known by construction."""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from fxremat.measure import MAX_TIMELINE_POINTS, Measurement, format_bytes, measure

# The module itself (the package may re-export the function under the same name).
measure_mod = importlib.import_module("fxremat.measure")

MiB = 2**20
FLOAT = 4  # bytes per float32
# Slack for the few-byte tensors ops make on the side (wrapped Python scalars,
# reduction buffers), seen in the profiler's events on torch 2.13.
SCALARS = 64


def _floats(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // FLOAT)


# ---------------------------------------------------------------------------
# format_bytes and Measurement
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (800, "800 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (12 * MiB, "12.0 MiB"),
        (512 * MiB, "512.0 MiB"),
        (3 * 2**29, "1.50 GiB"),
        (5 * 2**40, "5.00 TiB"),
        (2**50, "1024.0 TiB"),
        (-3 * 2**29, "-1.50 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_measurement_is_frozen_and_prints_units():
    m = Measurement(
        peak_bytes=12 * MiB,
        step_seconds=0.0123,
        all_step_seconds=(0.0123, 0.02, 0.01),
        timeline=((0.0, 0),),
        device="cpu",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.peak_bytes = 0
    assert str(m) == "cpu: peak 12.0 MiB above baseline, step 12.3 ms (median of 3)"


# ---------------------------------------------------------------------------
# Peak: known allocations
# ---------------------------------------------------------------------------


def test_peak_of_two_live_tensors_is_their_sum():
    def step():
        a = _floats(4 * MiB)
        b = _floats(8 * MiB)  # allocated while a is alive
        del a, b

    m = measure(step, reps=1)
    assert m.device == "cpu"
    assert m.peak_bytes == 12 * MiB
    assert [live for _, live in m.timeline] == [0, 4 * MiB, 12 * MiB, 8 * MiB, 0, 0]
    times = [t for t, _ in m.timeline]
    assert times == sorted(times) and times[0] == 0.0


def test_peak_of_sequential_tensors_is_the_larger():
    def step():
        a = _floats(4 * MiB)
        del a
        b = _floats(8 * MiB)
        del b

    assert measure(step, reps=1).peak_bytes == 8 * MiB


def test_views_cost_nothing():
    def step():
        a = _floats(4 * MiB)
        views = [a[1:], a.view(2, -1), a.t() if a.dim() == 2 else a.unsqueeze(0)]
        del a, views

    assert measure(step, reps=1).peak_bytes == 4 * MiB


def test_baseline_excludes_preexisting_tensors():
    big = _floats(16 * MiB)
    m = measure(lambda: big.add(1), reps=1)  # one 16 MiB temporary
    # Plus a few bytes: the wrapped Python scalar.
    assert 16 * MiB <= m.peak_bytes <= 16 * MiB + SCALARS


def test_free_of_warmup_memory_lowers_the_total_below_baseline():
    holder = [_floats(8 * MiB)]  # allocated before measure: invisible when freed

    def step():
        holder.pop()
        tmp = _floats(4 * MiB)
        del tmp
        holder.append(_floats(8 * MiB))

    m = measure(step, reps=1, warmup=1)
    # The 8 MiB freed by the measured step came from the warm-up, so its free
    # is seen: -8, -4, -8, 0. Nothing goes above the baseline.
    assert m.peak_bytes == 0
    assert min(live for _, live in m.timeline) == -8 * MiB
    assert m.timeline[-1][1] == 0


def test_return_value_of_step_is_not_kept():
    m = measure(lambda: _floats(8 * MiB), reps=1)
    assert m.peak_bytes == 8 * MiB
    assert m.timeline[-1][1] == 0


# ---------------------------------------------------------------------------
# Allocations inside ops and inside autograd
# ---------------------------------------------------------------------------


def test_allocations_inside_a_composite_op_are_seen():
    # cross_entropy = log_softmax (a 4 MiB temporary inside the op) + nll_loss.
    logits = torch.randn(1024, 1024)
    target = torch.randint(0, 1024, (1024,))
    m = measure(lambda: F.cross_entropy(logits, target), reps=1)
    assert 4 * MiB <= m.peak_bytes <= 4 * MiB + SCALARS


class _ScratchInBackward(torch.autograd.Function):
    """Identity whose backward allocates a 16 MiB scratch buffer."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        scratch = _floats(16 * MiB)
        del scratch
        return grad


def test_allocations_inside_autograd_backward_are_seen():
    x = torch.randn(1024, requires_grad=True)
    m = measure(lambda: _ScratchInBackward.apply(x).sum().backward(), reps=1)
    # Also alive at that point: x's clone and the grad (4 KiB each).
    assert 16 * MiB <= m.peak_bytes <= 16 * MiB + 2 * 1024 * FLOAT + SCALARS


def test_threads_started_by_the_step_are_not_seen():
    # Documented limitation: the profiler follows the calling thread only.
    def step():
        out = []
        t = threading.Thread(target=lambda: out.append(_floats(8 * MiB)))
        t.start()
        t.join()
        out.clear()

    assert measure(step, reps=1).peak_bytes == 0


# ---------------------------------------------------------------------------
# Training steps: gradients and saved activations
# ---------------------------------------------------------------------------

N_PARAM = 2**20  # floats in the parameter below (4 MiB)


def _scaled_sum_step(w: torch.nn.Parameter):
    # Forward: w * 2 (4 MiB, freed once sum() returns), loss (4 B).
    # Backward: ones seed (4 B), grad of w (4 MiB), accumulated into w.grad.
    # Plus scalars: the wrapped 2 and the sum's reduction buffer.
    return lambda: (w * 2).sum().backward()


def test_grad_buffer_from_warmup_is_baseline_but_returned_grad_counts():
    w = torch.nn.Parameter(torch.randn(N_PARAM))
    m = measure(_scaled_sum_step(w), reps=1, warmup=1)
    assert N_PARAM * FLOAT <= m.peak_bytes <= N_PARAM * FLOAT + SCALARS
    assert m.timeline[-1][1] == 0  # the returned grad was added into w.grad and freed


def test_grad_buffer_created_by_the_measured_step_counts_and_stays():
    w = torch.nn.Parameter(torch.randn(N_PARAM))
    m = measure(_scaled_sum_step(w), reps=1, warmup=0)
    assert N_PARAM * FLOAT <= m.peak_bytes <= N_PARAM * FLOAT + SCALARS
    assert m.timeline[-1][1] == N_PARAM * FLOAT  # now w.grad


def test_mlp_peak_matches_hand_count():
    B, D, L = 256, 128, 8
    torch.manual_seed(0)
    layers = []
    for _ in range(L):
        layers += [torch.nn.Linear(D, D), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(B, D)
    m = measure(lambda: model(x).sum().backward(), reps=1)

    act = B * D * FLOAT
    # The backward peaks in the last Linear's backward: the L - 1 ReLU outputs
    # still saved (the last one was released after its own backward), the
    # ReLU's input grad, the Linear's input grad, its weight and bias grads
    # (added into .grad afterwards), and the loss and its ones seed.
    by_hand = (L - 1) * act + act + act + D * D * FLOAT + D * FLOAT + 2 * FLOAT
    assert abs(m.peak_bytes - by_hand) <= 0.10 * by_hand, (m.peak_bytes, by_hand)
    assert m.timeline[-1][1] == 0


# ---------------------------------------------------------------------------
# Timeline
# ---------------------------------------------------------------------------


def test_long_timeline_is_decimated_and_keeps_the_peak():
    def step():
        live = [_floats(1024) for _ in range(1500)]
        live.clear()

    m = measure(step, reps=1, warmup=0)
    assert len(m.timeline) <= MAX_TIMELINE_POINTS
    assert max(live for _, live in m.timeline) == m.peak_bytes == 1500 * 1024
    assert m.timeline[0] == (0.0, 0) and m.timeline[-1][1] == 0


def test_decimate_keeps_extremes_and_endpoints():
    points = [(float(i), (i * 7919) % 1000) for i in range(10_000)]
    points[4321] = (4321.0, 5000)
    points[8765] = (8765.0, -5000)
    kept = measure_mod._decimate(points, 100)
    assert len(kept) <= 100
    assert kept[0] == points[0] and kept[-1] == points[-1]
    assert (4321.0, 5000) in kept and (8765.0, -5000) in kept
    assert [t for t, _ in kept] == sorted(t for t, _ in kept)
    assert measure_mod._decimate(points[:50], 100) == tuple(points[:50])


# ---------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------


class _FakeClock:
    """A clock that only the fake step moves, by scripted durations."""

    def __init__(self, durations):
        self.now = 0.0
        self.durations = list(durations)

    def __call__(self):
        return self.now

    def step(self):
        self.now += self.durations.pop(0)


def test_step_seconds_is_the_median_of_timed_steps(monkeypatch):
    # One warm-up, one memory step, then three timed steps.
    clock = _FakeClock([9.0, 7.0, 0.3, 0.1, 0.2])
    monkeypatch.setattr(measure_mod, "_clock", clock)
    m = measure(clock.step, reps=3, warmup=1)
    assert m.all_step_seconds == pytest.approx((0.3, 0.1, 0.2))
    assert m.step_seconds == pytest.approx(0.2)
    assert not clock.durations


def test_even_reps_median_averages_the_middle_two(monkeypatch):
    clock = _FakeClock([1.0, 0.4, 0.1, 0.2, 0.8])  # memory step, then 4 timed
    monkeypatch.setattr(measure_mod, "_clock", clock)
    m = measure(clock.step, reps=4, warmup=0)
    assert m.step_seconds == pytest.approx(0.3)


def test_step_seconds_ratio_follows_the_work():
    # Sleep-based so the ratio survives a noisy machine; no absolute bounds.
    short = measure(lambda: time.sleep(0.01), reps=3, warmup=0)
    long = measure(lambda: time.sleep(0.04), reps=3, warmup=0)
    assert 2.0 < long.step_seconds / short.step_seconds < 8.0


# ---------------------------------------------------------------------------
# Arguments and devices
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"reps": 0}, "reps >= 1"),
        ({"warmup": -1}, "warmup >= 0"),
        ({"device": "meta"}, "not supported"),
    ],
)
def test_bad_arguments_raise_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure(lambda: None, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_raises():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        measure(lambda: None, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_of_two_live_tensors_is_their_sum():
    def step():
        a = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        del a, b

    m = measure(step, reps=1)
    assert m.device.startswith("cuda")
    assert m.peak_bytes == 12 * MiB
    assert max(live for _, live in m.timeline) == 12 * MiB
