"""``explain`` on a model built on the meta device, the way people look at a model too large for
their machine: the same plan as the same model built under ``FakeTensorMode``, and the user's
model is left as it was."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxremat
from fxremat._torch_compat import FakeTensorMode


class Tied(nn.Module):
    """An embedding tied to the output projection, a buffer, and a plain MLP in between."""

    def __init__(self, vocab: int = 512, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(width))

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        return nn.functional.cross_entropy(self.head(self.body(h)).flatten(0, 1), ids.flatten())


def _explain(model, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxremat.explain(model, *args, inner="eager", **options)


def test_a_meta_model_plans_like_a_fake_one_and_stays_on_meta():
    with torch.device("meta"):
        meta = Tied()
    ids = torch.randint(0, 512, (4, 64)).to("meta")
    with FakeTensorMode():
        fake = Tied()
        fake_ids = torch.randint(0, 512, (4, 64))
    a = _explain(meta, ids, budget=1, on_infeasible="min")
    b = _explain(fake, fake_ids, budget=1, on_infeasible="min")
    assert (a.predicted_peak, a.fingerprint()) == (b.predicted_peak, b.fingerprint())
    assert all(p.is_meta for p in meta.parameters()) and meta.scale.is_meta
    assert meta.head.weight is meta.embed.weight
    points = fxremat.pareto(meta, ids, points=2, inner="eager", time_slack=0)
    assert points and all(p.predicted_peak > 0 for p in points)


def test_a_meta_hf_llama_plans_with_its_default_cache_setting():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    plan = _explain(model, ids, time_slack=0)
    with FakeTensorMode():
        fake = transformers.AutoModelForCausalLM.from_config(cfg)
        fake_ids = torch.zeros(2, 32, dtype=torch.long)
    assert plan.fingerprint() == _explain(fake, fake_ids, time_slack=0).fingerprint()
    assert plan.predicted_peak > 0 and plan.kept
