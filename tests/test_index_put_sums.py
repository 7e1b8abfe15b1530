"""A gradient summed with an embedding's gradient is accumulated into it (passes/index_put_sums.py)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxremat
from fxremat import planner
from fxremat.passes.index_put_sums import fold_sums_into_index_put
from tests.checks import compare

aten = torch.ops.aten
VOCAB, HIDDEN, TOKENS = 8192, 32, 8


def _sum_of_gradients(head_grad, mask, ids, rows):
    """What the joint graph of a tied embedding computes for the weight's gradient."""
    zeros = aten.full.default([VOCAB, HIDDEN], 0, dtype=torch.float32, layout=torch.strided, device="cpu")
    embedding = aten._unsafe_masked_index_put_accumulate.default(zeros, mask, [ids], rows)
    return aten.add.Tensor(head_grad, embedding)


def test_the_sum_is_accumulated_into_the_other_gradient_without_zeros():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    inputs = (
        torch.randn(VOCAB, HIDDEN, generator=g),
        (ids != 3).unsqueeze(-1),
        ids,
        torch.randn(TOKENS, HIDDEN, generator=g),
    )
    gm = make_fx(_sum_of_gradients)(*inputs)
    assert fold_sums_into_index_put(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.add.Tensor not in targets and aten.full.default not in targets
    torch.testing.assert_close(gm(*inputs), _sum_of_gradients(*inputs), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding", [-1, 3])
def test_an_undecomposed_embedding_backward_is_accumulated_into_the_other_gradient(padding):
    def summed(head_grad, rows, ids):
        return aten.add.Tensor(head_grad, aten.embedding_dense_backward.default(rows, ids, VOCAB, padding, False))

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (2, TOKENS), generator=g)  # repeated ids, and the padding index among them
    inputs = (torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(2, TOKENS, HIDDEN, generator=g), ids)
    gm = make_fx(summed, tracing_mode="fake")(*inputs)  # node values share one fake mode, as AOTAutograd's do
    assert fold_sums_into_index_put(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.add.Tensor not in targets and aten.embedding_dense_backward.default not in targets
    torch.testing.assert_close(gm(*inputs), summed(*inputs), rtol=1e-6, atol=1e-6)


def test_a_sum_of_symbolic_size_is_left_alone():
    vocab = torch.randn(VOCAB, HIDDEN)
    ids = torch.randint(0, VOCAB, (TOKENS,))
    gm = make_fx(_sum_of_gradients, tracing_mode="symbolic")(
        vocab, (ids != 3).unsqueeze(-1), ids, torch.randn(TOKENS, HIDDEN)
    )
    assert fold_sums_into_index_put(gm) == 0


def test_a_sum_that_broadcasts_is_left_alone():
    def broadcast(bias, mask, ids, rows):
        zeros = aten.full.default([VOCAB, HIDDEN], 0, dtype=torch.float32, layout=torch.strided, device="cpu")
        return aten.add.Tensor(bias, aten._unsafe_masked_index_put_accumulate.default(zeros, mask, [ids], rows))

    ids = torch.randint(0, VOCAB, (TOKENS,))
    gm = make_fx(broadcast)(torch.randn(HIDDEN), (ids != 3).unsqueeze(-1), ids, torch.randn(TOKENS, HIDDEN))
    assert fold_sums_into_index_put(gm) == 0


class TiedLM(torch.nn.Module):
    """An embedding whose weight is also the LM head's (GPT-2's tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(4 * HIDDEN, HIDDEN)
        )

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.mlp(h)
        logits = h @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


# Inductor's decompositions make the embedding's backward zeros and an accumulating index-put; the eager
# inner compiler keeps embedding_dense_backward whole: both are folded.
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_tied_embeddings_backward_peaks_one_weight_lower_and_trains_like_eager(inner, monkeypatch):
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = TiedLM()
    ref_loss = ref(ids)
    ref_loss.backward()
    peaks = {}
    for fold in (False, True):
        if not fold:
            monkeypatch.setattr(planner, "fold_sums_into_index_put", lambda gm: 0)
        else:
            monkeypatch.undo()
        torch._dynamo.reset()
        fxremat.clear_plans()
        torch.manual_seed(0)
        model = TiedLM()
        compiled = torch.compile(model, backend="fxremat", options={"inner": inner})
        loss = compiled(ids)
        loss.backward()
        compare(ref, ref_loss, model, loss)
        (plan,) = fxremat.plans()
        peaks[fold] = plan.predicted_peak
        for p in model.parameters():
            p.grad = None
        measured = fxremat.measure(lambda: compiled(ids).backward(), reps=1, warmup=0).peak_bytes
        assert measured <= plan.predicted_peak, (measured, plan.predicted_peak)
    weight = VOCAB * HIDDEN * 4
    # Without the fold three tensors of the weight's size are alive at once in the backward: its other
    # gradient, the zeros and the accumulated copy. With it, two (and the rows flattened, under eager).
    assert peaks[True] <= peaks[False] - 0.9 * weight, peaks
