"""Train a small GPT-2 for a few steps under three memory budgets, next to eager.

    python examples/quickstart.py              # Inductor, 4 steps per budget
    python examples/quickstart.py --inner eager --steps 2 --small

For each run it prints the measured peak memory of a training step (above what
existed before the step), the median step time, and the plan fxremat chose.
The budgets are picked from fxremat's own plans: the fastest plan's peak, a
point halfway down, and the least reachable peak.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch

import fxremat
from fxremat import format_bytes, measure


def build(small: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    layers, hidden, tokens, batch = (2, 64, 64, 2) if small else (4, 256, 256, 4)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=2048,
        n_positions=tokens,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # without it transformers warns inside forward: a graph break
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens))
    return model, ids


def train(model, ids, steps: int):
    """A few optimizer steps; returns the last loss and the measurement of one more step."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = None
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=False)
    m = measure(lambda: model(input_ids=ids, labels=ids).loss.backward(), reps=3, warmup=1)
    return loss.item(), m


def plan_peak(base, ids, inner: str, **options) -> int:
    """Predicted peak of the plan fxremat picks with these options (one compile, one step)."""
    torch._dynamo.reset()
    fxremat.clear_plans()
    model = torch.compile(copy.deepcopy(base), backend=fxremat.backend(inner=inner, **options))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, labels=ids).loss.backward()
    return sum(p.predicted_peak for p in fxremat.plans()[:1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="a tiny model, for smoke tests")
    args = parser.parse_args(argv)

    base, ids = build(args.small)
    loss, m = train(copy.deepcopy(base), ids, args.steps)
    print(f"{'eager':<28} loss {loss:.4f}  peak {format_bytes(m.peak_bytes):>10}  step {m.step_seconds * 1e3:8.1f} ms")

    fastest = plan_peak(base, ids, args.inner, time_slack=0)
    least = plan_peak(base, ids, args.inner, budget=1, on_infeasible="min")
    for budget in (fastest, (fastest + least) // 2, least):
        torch._dynamo.reset()
        fxremat.clear_plans()
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend=fxremat.backend(budget=budget, inner=args.inner))
        loss, m = train(compiled, ids, args.steps)
        label = f"fxremat budget {format_bytes(budget)}"
        print(
            f"{label:<28} loss {loss:.4f}  peak {format_bytes(m.peak_bytes):>10}  step {m.step_seconds * 1e3:8.1f} ms"
        )
        for plan in fxremat.plans():
            print("    " + plan.summary())
    largest = max(fxremat.plans(), key=lambda p: p.predicted_peak)
    print("\nThe least-memory run's main graph, in full:\n")
    print(largest)


if __name__ == "__main__":
    main()
