"""The literature's activation figures, reproduced by fxremat.explain; writes docs/LITERATURE.md.

    .venv/bin/python benchmarks/literature.py [--layers 28]

A GPT-style model (HF GPT-2 architecture: 28 layers, hidden 2048, 16 heads,
batch 2, 1024 tokens, bf16, SDPA attention, exact GELU as one op, as the
paper's fused kernels assume; HF's default tanh GELU is four pointwise ops whose
intermediates an unfused graph would keep too) is built under FakeTensorMode:
no weight or activation is allocated. Korthikanti et al. 2022 count
``34 * s * b * h`` bytes of activations per layer in 16-bit with efficient
attention (about 0.14 GB here); keeping only each layer's input costs
``2 * s * b * h`` bytes per layer.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

import fxremat
from fxremat._torch_compat import FakeTensorMode

ROOT = Path(__file__).resolve().parents[1]
LAYER = re.compile(r"transformer\.h\.(\d+)")


class LMLoss(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def build(layers: int, hidden: int, heads: int, vocab: int, tokens: int, batch: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        vocab_size=vocab,
        n_positions=tokens,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu",
    )
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: fake weights cannot be converted after
    try:
        with FakeTensorMode():
            model = LMLoss(GPT2LMHeadModel(cfg))
            ids = torch.zeros(batch, tokens, dtype=torch.long)
    finally:
        torch.set_default_dtype(default)
    return model, ids


def per_layer(plan) -> tuple[dict[int, int], int]:
    layers: dict[int, int] = {}
    outside = 0
    for k in plan.kept:
        m = LAYER.search(k.module)
        if m:
            layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + k.nbytes
        else:
            outside += k.nbytes
    return layers, outside


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    L, h, a, V, s, b = args.layers, 2048, 16, 50257, 1024, 2
    model, ids = build(L, h, a, V, s, b)
    paper = 34 * s * b * h
    inputs_only = 2 * s * b * h
    logits = b * s * V * 2
    rows = []
    started = time.time()
    for solver in ("save_all", "per_layer"):
        import warnings

        before = len(fxremat.plans())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fxremat.explain(model, ids, inner="eager", solver=solver, hardware="h100")
        graphs = fxremat.plans()[before:]
        plan = max(graphs, key=lambda p: p.num_nodes)  # the transformer; the HF loss is its own graph
        layers, outside = per_layer(plan)
        mean = sum(layers.values()) / max(1, len(layers))
        loss_graphs = [p for p in graphs if p is not plan]
        rows.append((solver, plan, layers, outside, mean, loss_graphs))
        print(solver, plan.summary(), flush=True)
    seconds = time.time() - started
    save_all, per = rows[0], rows[1]
    lines = [
        "# Activation memory against the literature",
        "",
        f"Regenerate with `.venv/bin/python benchmarks/literature.py` ({seconds:.0f} s). The model is a GPT-2-style",
        f"transformer built under `FakeTensorMode` (nothing allocated): {L} layers, hidden {h}, {a} heads,",
        f"batch {b}, {s} tokens, vocabulary {V}, bf16, SDPA attention, one-op GELU; planned by `fxremat.explain`.",
        "Dropout is 0, so the paper's dropout masks (about 2 of its 34 s*b*h) do not exist here.",
        "",
        "| quantity | fxremat | reference | ratio |",
        "|---|---|---|---|",
        f"| kept per layer, nothing recomputed (`save_all`) | {save_all[4] / 1e9:.3f} GB | 34*s*b*h = {paper / 1e9:.3f} GB"
        f" (Korthikanti et al. 2022) | {save_all[4] / paper:.2f} |",
        f"| kept for {L} layers, `save_all` | {sum(save_all[2].values()) / 1e9:.2f} GB | {L * paper / 1e9:.2f} GB |"
        f" {sum(save_all[2].values()) / (L * paper):.2f} |",
        f"| kept per layer, layer inputs only (`per_layer`) | {per[4] / 1e9:.4f} GB | 2*s*b*h = {inputs_only / 1e9:.4f} GB |"
        f" {per[4] / inputs_only:.2f} |",
        f"| kept for {L} layers, `per_layer` | {sum(per[2].values()) / 1e9:.3f} GB | {L * inputs_only / 1e9:.3f} GB |"
        f" {sum(per[2].values()) / (L * inputs_only):.2f} |",
        f"| logits (b*s*V*2 bytes), its own line | see below | {logits / 1e9:.3f} GB | |",
        "",
        "Kept in the transformer graph outside the layers (embeddings, final norm): "
        f"`save_all` {save_all[3] / 1e9:.3f} GB, `per_layer` {per[3] / 1e9:.3f} GB.",
        f"The logits, b*s*V*2 = {logits / 1e9:.3f} GB in bf16, leave the transformer graph as its output"
        f" ({save_all[1].output_bytes / 1e9:.3f} GB predicted) and",
        "feed the loss, which HF computes in a graph of its own (a graph break) after upcasting to fp32: it keeps "
        + ", ".join(f"{p.saved_bytes / 1e9:.3f} GB" for p in save_all[5])
        + " for its backward. No remat plan",
        "removes these: only a fused or chunked cross-entropy would.",
        "",
        "Plans:",
        "",
        "```",
        save_all[1].summary(),
        per[1].summary(),
        *[p.summary() for p in save_all[5]],
        "```",
        "",
    ]
    (ROOT / "docs" / "LITERATURE.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
