"""Small real models for the tests: each builder returns (model, example inputs).

Every model's forward returns a scalar loss, so a training step is
``model(*inputs).backward()``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPChain(nn.Module):
    def __init__(self, width: int = 128, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        h = self.body(x).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h), y)


class Block(nn.Module):
    """Pre-norm transformer block with SDPA attention."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


class DropoutNet(nn.Module):
    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 1)

    def forward(self, x):
        x = F.dropout(torch.relu(self.fc1(x)), p=0.3, training=self.training)
        x = F.dropout(torch.relu(self.fc2(x)), p=0.3, training=self.training)
        return self.fc3(x).mean()


class InplaceViews(nn.Module):
    """In-place activations, views, transposes and slicing."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        h = self.fc1(x)
        h.relu_()
        a, b = h.chunk(2, dim=-1)
        a = a + b.t().t()
        a.mul_(2.0)
        c = a.view(-1, a.shape[-1] // 2, 2).transpose(1, 2).reshape(a.shape)
        c = c[:, : c.shape[1] // 2].contiguous()
        d = self.fc2(torch.cat([c, c], dim=-1))
        d.add_(1.0).sigmoid_()
        return d.sum() / d.numel()


def mlp():
    torch.manual_seed(0)
    return MLPChain(), (torch.randn(256, 128),)


def cnn():
    torch.manual_seed(0)
    return SmallCNN(), (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))


def transformer():
    torch.manual_seed(0)
    return Transformer(), (torch.randn(4, 32, 64),)


def dropout():
    torch.manual_seed(0)
    return DropoutNet(), (torch.randn(128, 96),)


def inplace_views():
    torch.manual_seed(0)
    return InplaceViews(), (torch.randn(64, 64),)


class HFLoss(nn.Module):
    """A transformers causal LM whose forward returns the LM loss."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(cfg)  # no loss_type: its warning is traced through (fxremat/graph_breaks.py)
    return HFLoss(model), (torch.randint(0, 256, (2, 32)),)


def llama(**config):
    """A 2-layer HF Llama; ``config`` overrides ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **{
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 64,
            **config,
        }
    )
    cfg._attn_implementation = "sdpa"
    return HFLoss(LlamaForCausalLM(cfg)), (torch.randint(0, cfg.vocab_size, (2, 32)),)


ZOO = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "dropout": dropout,
    "inplace_views": inplace_views,
    "gpt2": gpt2,
    "llama": llama,
}
