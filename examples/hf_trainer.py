"""Train a tiny GPT-2 with transformers.Trainer, compiled by fxremat under a memory budget.

    python examples/hf_trainer.py                       # budget from FXREMAT_BUDGET (default 64MiB)
    FXREMAT_BUDGET=32MiB python examples/hf_trainer.py --steps 8
    python examples/hf_trainer.py --small --steps 1 --inner eager   # smoke test

The model is compiled in place with `model.compile(backend="fxremat")` before
it is handed to the Trainer. `TrainingArguments(torch_compile=True,
torch_compile_backend="fxremat")` does not work with accelerate (1.15): its
TorchDynamoPlugin only accepts the backends in its DynamoBackend enum and
raises "ValueError: 'FXREMAT' is not a valid DynamoBackend". A backend name
carries no options, so the budget comes from the environment variable
FXREMAT_BUDGET either way. After training the script prints every plan fxremat
made and checks that each plan's predicted peak fits the budget.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch

import fxremat
from fxremat import format_bytes


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences; the labels are the inputs (the model shifts them)."""

    def __init__(self, n: int, tokens: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, tokens), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build(small: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    layers, hidden, tokens, vocab = (1, 32, 32, 256) if small else (4, 256, 128, 2048)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=vocab,
        n_positions=tokens,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg), TokenDataset(64, tokens, vocab)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--small", action="store_true", help="a tiny model, for smoke tests")
    args = parser.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    os.environ.setdefault("FXREMAT_BUDGET", "64MiB")
    budget = fxremat.parse_budget(os.environ["FXREMAT_BUDGET"], name="FXREMAT_BUDGET")
    print(f"FXREMAT_BUDGET={os.environ['FXREMAT_BUDGET']} ({format_bytes(budget)})")

    model, data = build(args.small)
    # In place, so the Trainer still sees a GPT2LMHeadModel. No "budget" option: FXREMAT_BUDGET gives it.
    model.compile(backend="fxremat", options={"inner": args.inner})
    fxremat.clear_plans()
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=tmp,
            max_steps=args.steps,
            per_device_train_batch_size=2,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_steps=1,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = trainer.train()
    print(f"trained {result.global_step} steps, final train loss {result.training_loss:.4f}")

    plans = fxremat.plans()
    assert plans, "fxremat made no plan: was the model compiled with backend='fxremat'?"
    print(f"fxremat made {len(plans)} plan(s):")
    for plan in plans:
        print("    " + plan.summary())
        assert plan.predicted_peak <= budget, (
            f"{plan.graph}: predicted peak {format_bytes(plan.predicted_peak)} over budget {format_bytes(budget)}"
        )
    print(f"every plan's predicted peak fits the budget {format_bytes(budget)}")


if __name__ == "__main__":
    main()
