"""The chunked loss under Inductor: each chunk runs the same kernels, and the backward frees a chunk's
logits gradient before the next chunk's is made.

Inductor writes the offset of a view, and a constant such as a slice's first class, into the code of
each kernel that reads it. When every chunk read its targets as a slice of the batch's and compared
them with ``arange(start, end)``, each chunk compiled kernels of its own (21 C++ kernels for this
test's model in 16 chunks, 1.6-2 s of compiler each on a 2-core host), and in the backward Inductor
fused the chunks' logits gradients into one kernel that made them all before any was used: 17.5 MiB
predicted against the 16 MiB of logits chunking was there to avoid.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import fxremat

from checks import compare

H, V, T, CHUNKS = 64, 4096, 1024, 16
LOGITS = T * V * 4


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, x, y):
        return F.cross_entropy(self.head(torch.tanh(self.body(x))), y)


@pytest.mark.xdist_group("chunk_kernels")
def test_each_chunk_runs_the_same_kernels_and_the_backward_holds_one_chunk_of_logits():
    torch.manual_seed(0)
    ref_model = Head()
    x, y = torch.randn(T, H), torch.randint(0, V, (T,))
    y[::7] = -100
    model = copy.deepcopy(ref_model)
    ref = ref_model(x, y)
    ref.backward()
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(model, backend="fxremat", options={"chunk_loss": CHUNKS, "budget": "48MiB"})

    def step():
        loss = compiled(x, y)
        loss.backward()
        return loss

    loss, codes = run_and_get_code(step)
    compare(ref_model, ref, model, loss)
    kernels = re.findall(r"async_compile\.cpp_pybinding\(\[.*?\], r?'''(.*?)'''", "\n".join(codes), re.S)
    assert kernels, "no C++ kernel found in Inductor's code"
    # 7 here (the body, the loss's reductions, one kernel shared by every chunk in each direction).
    assert len(set(kernels)) < CHUNKS // 2, f"{len(set(kernels))} distinct kernels for {CHUNKS} chunks"
    (plan,) = fxremat.plans()
    assert plan.chunked and f"{CHUNKS} chunks" in plan.chunked[0]
    # One chunk's logits and their gradient at a time: 2.9 MiB here (17.5 MiB when fused).
    assert plan.predicted_peak < LOGITS / 4
    measured = fxremat.measure(step, reps=1, warmup=0)
    assert measured.peak_bytes < LOGITS / 4
