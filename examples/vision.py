"""Train a vision transformer (HF ViT) under a memory budget in bytes, next to eager.

    python examples/vision.py                        # ViT: 4 layers, hidden 256, 64x64 images, batch 8; Inductor
    python examples/vision.py --budget 24MiB --steps 8
    python examples/vision.py --small --steps 1 --inner eager   # smoke test

A ``transformers.ViTForImageClassification`` is built from a ``ViTConfig``
(random weights, nothing is downloaded) and trained with SGD on random images
and labels, twice from the same initial weights: eager, and
``torch.compile(model, backend="fxremat", options={"budget": budget, "inner": ...})``.
For each it prints the measured peak memory of one training step (forward,
backward and SGD update; ``fxremat.measure``: what the step allocates above
what exists before it) and the step time (median of the timed steps, after the
first, compiling, step and a warm-up). It checks that fxremat's first-step
loss and gradients match eager's and that its measured peak is within the
budget, and exits with status 1 when a check fails.

The default budget is halfway between eager's measured peak and the least
peak fxremat can reach (``fxremat.explain(..., budget=1, on_infeasible="min")``,
a dry plan: no step runs).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
import warnings

import torch

import fxremat
from fxremat import format_bytes, measure

# Tolerances of the agreement with eager (float32; Inductor reorders reductions).
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-5


class LossOf(torch.nn.Module):
    """The classification loss of a batch of images and labels, as one module (for compile and explain)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images, labels):
        return self.model(pixel_values=images, labels=labels).loss


def build(small: bool) -> tuple[LossOf, torch.Tensor, torch.Tensor]:
    """The model (random weights from a fixed seed), a batch of random images and their labels."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    layers, hidden, size, patch, batch = (2, 64, 32, 8, 4) if small else (4, 256, 64, 8, 8)
    classes = 10
    cfg = ViTConfig(
        image_size=size,
        patch_size=patch,
        num_channels=3,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
        num_labels=classes,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    cfg._attn_implementation = "sdpa"
    model = ViTForImageClassification(cfg)
    model.train()
    images = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, classes, (batch,))
    return LossOf(model), images, labels


def train(model: LossOf, fn, batch: tuple, steps: int):
    """The first step (its loss and gradients kept), then ``steps`` timed training steps.

    Returns:
        (first loss, first gradients by name, first step's seconds, fxremat.Measurement of a step).
    """
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = fn(*batch)
        loss.backward()
    first_seconds = time.perf_counter() - start
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()

    def step():
        opt.zero_grad(set_to_none=False)  # keep the .grad buffers: they exist whatever the plan
        fn(*batch).backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = measure(step, reps=steps, warmup=1)
    return loss.item(), grads, first_seconds, m


def gradient_mismatches(grads: dict, ref: dict) -> list[str]:
    """Parameters whose gradient differs from the reference's (an empty list when all match)."""
    if grads.keys() != ref.keys():
        return [f"gradients of {sorted(grads.keys() ^ ref.keys())} exist in only one run"]
    return [
        f"{name} (max abs difference {(grads[name] - ref[name]).abs().max().item():.2e})"
        for name in sorted(ref)
        if not torch.allclose(grads[name], ref[name], rtol=GRAD_RTOL, atol=GRAD_ATOL)
    ]


def load_note() -> str:
    """A warning line when other processes keep the CPUs busy (step times are then noisy), else ""."""
    if not hasattr(os, "getloadavg"):
        return ""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load < cpus / 2:
        return ""
    return (
        f"note: load average {load:.1f} on {cpus} CPUs: other processes share them, so step times "
        f"are noisy (compare them on an idle machine)\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget",
        default=None,
        help="bytes or a string with a unit, e.g. 24MiB (default: halfway between eager's "
        "measured peak and fxremat's least)",
    )
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after 3 others)")
    parser.add_argument("--small", action="store_true", help="a tiny model, for smoke tests")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    base, images, labels = build(args.small)
    batch = (images, labels)
    cfg = base.model.config
    patches = (cfg.image_size // cfg.patch_size) ** 2
    print(
        f"ViT: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.image_size}x{cfg.image_size} "
        f"images in {patches} patches of {cfg.patch_size}x{cfg.patch_size}, batch {len(images)}, "
        f"{cfg.num_labels} classes, {args.steps} timed steps per run.\n"
        f"peak: of one training step, above weights, gradients and inputs; step: median of the timed steps\n"
        f"{load_note()}",
        flush=True,
    )

    def show(label: str, loss: float, first_seconds: float, m, extra: str = "") -> None:
        print(
            f"{label:<20} loss {loss:.4f}  peak {format_bytes(m.peak_bytes):>10}  "
            f"step {m.step_seconds * 1e3:7.1f} ms ({len(images) / m.step_seconds:6.1f} images/s)  "
            f"first step {first_seconds:5.1f} s{extra}",
            flush=True,
        )

    eager_model = copy.deepcopy(base)
    ref_loss, ref_grads, first, m_eager = train(eager_model, eager_model, batch, args.steps)
    show("eager", ref_loss, first, m_eager)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "budget below the least peak": asked for on purpose
        least = fxremat.explain(base, *batch, budget=1, on_infeasible="min", inner=args.inner).predicted_peak
    if args.budget is not None:
        budget, why = fxremat.parse_budget(args.budget), "--budget"
    else:
        budget, why = (m_eager.peak_bytes + least) // 2, "halfway between eager's measured peak and fxremat's least"
    print(
        f"\nbudget {format_bytes(budget)}: {why} (fxremat's least reachable predicted peak {format_bytes(least)})\n",
        flush=True,
    )

    torch._dynamo.reset()
    fxremat.clear_plans()
    fx_model = copy.deepcopy(base)
    compiled = torch.compile(fx_model, backend="fxremat", options={"budget": budget, "inner": args.inner})
    try:
        loss, grads, first, m_fx = train(fx_model, compiled, batch, args.steps)
    except fxremat.BudgetError as err:
        print(f"no plan fits: {err}")
        return 1
    gc.collect()  # graphs of earlier dry plans are gone: only this model's plans run
    plans = fxremat.running_plans()  # what the measured steps ran (.grad kept: planned for that)
    show(
        f"fxremat ({args.inner})",
        loss,
        first,
        m_fx,
        f"  (predicted peak {format_bytes(max(p.predicted_peak for p in plans))})",
    )
    for plan in plans:
        print("    " + plan.summary())

    print("\nchecks:")
    loss_ok = abs(loss - ref_loss) <= LOSS_ATOL + LOSS_RTOL * abs(ref_loss)
    print(f"  first-step loss: fxremat {loss:.6f}, eager {ref_loss:.6f}: {'match' if loss_ok else 'MISMATCH'}")
    bad = gradient_mismatches(grads, ref_grads)
    verdict = "MISMATCH: " + "; ".join(bad[:5]) if bad else "match eager's"
    print(f"  first-step gradients: {verdict}")
    fits = m_fx.peak_bytes <= budget
    print(
        f"  fxremat's measured peak {format_bytes(m_fx.peak_bytes)} ({m_fx.peak_bytes} B) is "
        f"{'within' if fits else 'OVER'} the budget {format_bytes(budget)} ({budget} B)"
    )
    print(
        f"  fxremat: {m_fx.peak_bytes / m_eager.peak_bytes:.2f}x eager's peak, "
        f"{m_fx.step_seconds / m_eager.step_seconds:.2f}x its step time"
    )
    failed = not (loss_ok and fits) or bool(bad)
    print(f"\n{'a check FAILED' if failed else 'all checks passed'}; total time {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
