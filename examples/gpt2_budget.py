"""Train GPT-2 under a memory budget in bytes, next to eager and per-layer checkpointing.

    python examples/gpt2_budget.py                    # 4 layers, hidden 256, batch 2 x 256 tokens; Inductor
    python examples/gpt2_budget.py --budget 40MiB --steps 8 --out /tmp/gpt2_plan
    python examples/gpt2_budget.py --small --steps 1 --inner eager   # smoke test

A GPT-2 (``transformers.GPT2LMHeadModel``) is built from a config (random
weights, nothing is downloaded) and trained with SGD on random tokens three
ways, each from the same initial weights:

- eager;
- eager with HF per-layer checkpointing (non-reentrant ``torch.utils.checkpoint``
  around every block: ``gradient_checkpointing_enable``, which transformers 5
  renames ``activation_checkpointing_enable``);
- ``torch.compile(model, backend="fxremat", options={"budget": budget, "inner": ...})``.

For each it prints the measured peak memory of one training step (forward,
backward and SGD update; ``fxremat.measure``: what the step allocates above
what exists before it, so weights, ``.grad`` buffers and inputs are not
counted), the training throughput in tokens/s (median of the timed steps,
after the first step and a warm-up), and the first step's wall time (which
includes compiling). It checks the first step's loss and gradients of
checkpointing and fxremat against eager's and that fxremat's measured peak is
within the budget, and saves fxremat's plan (``plan.txt``, ``plan.json``, the
forward and backward programs, the graph and a memory timeline with the
measured step overlaid) to ``--out``. It exits with status 1 when a check
fails.

The default budget is halfway between eager's measured peak and the least
peak fxremat can reach (``fxremat.explain(..., budget=1, on_infeasible="min")``,
a dry plan: no step runs). Each strategy runs ``--steps`` timed steps after
three others: the first (compiling) step, a warm-up and the memory-measured step.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import fxremat
from fxremat import format_bytes, measure

# Tolerances of the agreement with eager (float32; Inductor reorders reductions).
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-5


class LossOf(torch.nn.Module):
    """The language-model loss of a batch of token ids, as one module (for compile and explain)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids).loss


def build(small: bool) -> tuple[LossOf, torch.Tensor]:
    """The model (random weights from a fixed seed) and a batch of random tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    layers, hidden, tokens, batch, vocab = (2, 64, 64, 2, 1024) if small else (4, 256, 256, 2, 2048)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=vocab,
        n_positions=tokens,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = "sdpa"
    lm = GPT2LMHeadModel(cfg)
    # GPT2LMHeadModel's class name does not tell transformers which loss it uses; left unset, the
    # loss logs a warning inside the forward, which splits the compiled step into two graphs.
    lm.loss_type = "ForCausalLM"
    lm.train()
    ids = torch.randint(0, vocab, (batch, tokens))
    return LossOf(lm), ids


def enable_checkpointing(lm) -> None:
    """HF per-layer checkpointing, non-reentrant."""
    kwargs = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers 5; the old name is a deprecated alias
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@dataclass
class Run:
    """One strategy's training run."""

    loss: float
    """Loss of the first step."""
    grads: dict
    """Parameter gradients of the first step, by name."""
    first_seconds: float
    """Wall time of the first forward and backward (includes compiling)."""
    m: fxremat.Measurement
    """The training step, measured after the first step."""


def train(model: LossOf, fn, ids, steps: int) -> Run:
    """The first step (loss and gradients kept), then the measured training steps.

    Args:
        model: the module whose parameters are trained.
        fn: ``model`` itself, or ``model`` compiled.
        ids: the batch.
        steps: timed steps (``fxremat.measure``'s ``reps``).
    """
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = fn(ids)
        loss.backward()
    first_seconds = time.perf_counter() - start
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()

    def step():
        opt.zero_grad(set_to_none=False)  # keep the .grad buffers: they exist whatever the plan
        fn(ids).backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = measure(step, reps=steps, warmup=1)
    return Run(loss.item(), grads, first_seconds, m)


def mismatches(run: Run, ref: Run) -> list[str]:
    """What differs from the reference's first step (an empty list when everything matches)."""
    bad = []
    if abs(run.loss - ref.loss) > LOSS_ATOL + LOSS_RTOL * abs(ref.loss):
        bad.append(f"loss {run.loss:.6f} vs {ref.loss:.6f}")
    if run.grads.keys() != ref.grads.keys():
        bad.append(f"gradients of {sorted(run.grads.keys() ^ ref.grads.keys())} exist in only one run")
    for name in sorted(run.grads.keys() & ref.grads.keys()):
        if not torch.allclose(run.grads[name], ref.grads[name], rtol=GRAD_RTOL, atol=GRAD_ATOL):
            diff = (run.grads[name] - ref.grads[name]).abs().max().item()
            bad.append(f"gradient of {name} (max abs difference {diff:.2e})")
    return bad


def least_and_fastest(model: LossOf, ids, inner: str) -> tuple[int, int]:
    """fxremat's least reachable predicted peak and its fastest plan's, from one dry plan."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "budget below the least peak": asked for on purpose
        plan = fxremat.explain(model, ids, budget=1, on_infeasible="min", inner=inner)
    return plan.predicted_peak, plan.fastest_peak


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


def print_row(label: str, run: Run, tokens: int, extra: str = "") -> None:
    m = run.m
    print(
        f"{label:<32} loss {run.loss:.4f}  peak {format_bytes(m.peak_bytes):>10}  "
        f"{tokens / m.step_seconds:7.0f} tokens/s  step {m.step_seconds * 1e3:7.1f} ms  "
        f"first step {run.first_seconds:5.1f} s{extra}",
        flush=True,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget",
        default=None,
        help="bytes or a string with a unit, e.g. 40MiB (default: halfway between eager's "
        "measured peak and fxremat's least)",
    )
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per strategy (after 3 others)")
    parser.add_argument("--out", default="plan_out/gpt2_budget", help="folder for fxremat's plan")
    parser.add_argument("--small", action="store_true", help="a tiny model, for smoke tests")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    base, ids = build(args.small)
    tokens = ids.numel()
    cfg = base.lm.config
    print(
        f"GPT-2: {cfg.n_layer} layers, hidden {cfg.n_embd}, vocabulary {cfg.vocab_size}, "
        f"batch {ids.shape[0]} x {ids.shape[1]} tokens, {args.steps} timed steps per strategy.\n"
        f"peak: of one training step, above weights, gradients and inputs; tokens/s and step: median "
        f"of the timed steps\n{load_note()}",
        flush=True,
    )

    eager_model = copy.deepcopy(base)
    eager = train(eager_model, eager_model, ids, args.steps)
    print_row("eager", eager, tokens)

    ckpt_model = copy.deepcopy(base)
    enable_checkpointing(ckpt_model.lm)
    ckpt = train(ckpt_model, ckpt_model, ids, args.steps)
    print_row("eager + per-layer checkpointing", ckpt, tokens)

    start = time.perf_counter()
    least, fastest = least_and_fastest(base, ids, args.inner)
    plan_seconds = time.perf_counter() - start
    if args.budget is not None:
        budget, why = fxremat.parse_budget(args.budget), "--budget"
    else:
        budget, why = (eager.m.peak_bytes + least) // 2, "halfway between eager's measured peak and fxremat's least"
    print(
        f"\nbudget {format_bytes(budget)}: {why} (fxremat's least reachable predicted peak "
        f"{format_bytes(least)}, its fastest plan's {format_bytes(fastest)}; planned dry in {plan_seconds:.1f} s)\n",
        flush=True,
    )

    torch._dynamo.reset()
    fxremat.clear_plans()
    fx_model = copy.deepcopy(base)
    compiled = torch.compile(fx_model, backend="fxremat", options={"budget": budget, "inner": args.inner})
    try:
        fx = train(fx_model, compiled, ids, args.steps)
    except fxremat.BudgetError as err:
        print(f"no plan fits: {err}")
        return 1
    gc.collect()  # the dry plan's graph (least_and_fastest) is gone: only this model's plans run
    # The plans the measured steps ran: with .grad kept between steps, the graph is planned again
    # for such steps (fxremat.plans() also holds the first plan, made for the first step).
    plans = fxremat.running_plans()
    predicted = max(p.predicted_peak for p in plans)
    print_row(f"fxremat ({args.inner})", fx, tokens, f"  (predicted peak {format_bytes(predicted)})")

    print("\nfxremat's plan:")
    for plan in plans:
        print("    " + plan.summary())
    out = Path(args.out)
    for plan in plans:
        # One folder per graph when the step compiled into several (graph breaks).
        folder = out if len(plans) == 1 else out / plan.graph.replace(" ", "_")
        written = plan.save(folder, measured=fx.m if len(plans) == 1 else None)
        print(f"saved to {folder.resolve()}: {', '.join(p.name for p in written)}")

    print("\nchecks:")
    failed = False
    for label, run in (("checkpointing", ckpt), ("fxremat", fx)):
        bad = mismatches(run, eager)
        failed |= bool(bad)
        verdict = "MISMATCH: " + "; ".join(bad[:5]) if bad else "match eager's"
        print(f"  first-step loss and gradients, {label}: {verdict} (loss {run.loss:.6f}, eager {eager.loss:.6f})")
    fits = fx.m.peak_bytes <= budget
    failed |= not fits
    print(
        f"  fxremat's measured peak {format_bytes(fx.m.peak_bytes)} ({fx.m.peak_bytes} B) is "
        f"{'within' if fits else 'OVER'} the budget {format_bytes(budget)} ({budget} B)"
    )
    print(
        f"  fxremat: {fx.m.peak_bytes / eager.m.peak_bytes:.2f}x eager's peak at "
        f"{eager.m.step_seconds / fx.m.step_seconds:.2f}x its tokens/s; "
        f"{fx.m.peak_bytes / ckpt.m.peak_bytes:.2f}x checkpointing's peak at "
        f"{ckpt.m.step_seconds / fx.m.step_seconds:.2f}x its tokens/s"
    )
    print(f"\n{'a check FAILED' if failed else 'all checks passed'}; total time {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
