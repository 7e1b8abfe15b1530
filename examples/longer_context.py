"""Reach for recomputation before cutting the maximum length.

    python examples/longer_context.py                  # GPT-2 (4 layers, hidden 256), budget 64MiB
    python examples/longer_context.py --budget 32MiB
    python examples/longer_context.py --small          # tiny model, short lengths (smoke test)

At a fixed memory budget (bytes), find the longest sequence length whose
training step fits:

- plain eager: the measured peak of a step (``fxremat.measure``) is within the budget;
- fxremat: the model compiled with ``torch.compile(model, backend=fxremat.backend(budget=...))``
  finds a plan (its first step raises no ``fxremat.BudgetError``), and a compiled step,
  measured, is within the budget.

Then it prints both lengths and their ratio.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import fxremat
from fxremat import format_bytes, measure


class LossOf(torch.nn.Module):
    """The language-model loss of a batch of token ids, as one module (for explain and compile)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids).loss


def build(small: bool, max_len: int) -> LossOf:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    layers, hidden, vocab = (2, 32, 256) if small else (4, 256, 2048)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=vocab,
        n_positions=max_len,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = "sdpa"
    lm = GPT2LMHeadModel(cfg)
    # GPT2LMHeadModel sets no loss_type; transformers then warns inside forward, which breaks
    # the graph in two, each planned under the whole budget. Naming it keeps one graph.
    lm.loss_type = "ForCausalLM"
    return LossOf(lm)


def eager_peak(model: LossOf, ids) -> int:
    model.zero_grad(set_to_none=False)
    return measure(lambda: model(ids).backward(), reps=1, warmup=1).peak_bytes


def fxremat_peak(model: LossOf, ids, budget: int) -> tuple[int, int] | None:
    """(predicted, measured) peak of one compiled step under the budget, or None when no plan fits it."""
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(model, backend=fxremat.backend(budget=budget, inner="eager"))
    model.zero_grad(set_to_none=False)
    try:
        # The warm-up step compiles, and raises BudgetError when no plan fits.
        measured = measure(lambda: compiled(ids).backward(), reps=1, warmup=1).peak_bytes
    except fxremat.BudgetError:
        return None
    return max(p.predicted_peak for p in fxremat.running_plans()), measured


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default=None, help="bytes or a string with a unit (default 64MiB; --small 3.5MiB)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="a tiny model and short lengths, for smoke tests")
    args = parser.parse_args(argv)

    budget = fxremat.parse_budget(args.budget or ("3.5MiB" if args.small else "64MiB"))
    lengths = [32, 64, 128, 256] if args.small else [64, 128, 256, 512, 1024, 2048, 4096]
    model = build(args.small, max(lengths))
    print(f"budget {format_bytes(budget)}, batch {args.batch}, lengths {lengths}")

    # Eager first (cheap): the longest length whose measured step fits.
    best_eager = 0
    for length in lengths:
        ids = torch.randint(0, model.lm.config.vocab_size, (args.batch, length))
        peak = eager_peak(model, ids)
        print(f"length {length:>5}: eager   peak {format_bytes(peak):>10}")
        if peak > budget:
            break
        best_eager = length

    # fxremat from there on: a plan must exist, and one real compiled step must fit.
    best_remat = best_eager
    for length in [n for n in lengths if n > best_eager]:
        ids = torch.randint(0, model.lm.config.vocab_size, (args.batch, length))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remat = fxremat_peak(model, ids, budget)
        torch._dynamo.reset()
        if remat is None:
            print(f"length {length:>5}: fxremat: no plan fits (BudgetError)")
            break
        print(f"length {length:>5}: fxremat peak {format_bytes(remat[1]):>10}  (predicted {format_bytes(remat[0])})")
        if remat[1] > budget:
            break
        best_remat = length

    print(f"\nlongest length within {format_bytes(budget)}: eager {best_eager}, fxremat {best_remat}")
    if best_eager:
        print(f"fxremat fits {best_remat / best_eager:.1f}x the sequence length of eager")
    else:
        print("eager fits no length in the list")


if __name__ == "__main__":
    main()
