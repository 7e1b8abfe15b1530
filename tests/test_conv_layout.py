"""Channels-last convolutions where they pay (fxremat/conv_layout.py)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxremat.conv_layout import CHANNELS_LAST_FROM, channels_last_pays, convolution_bytes


def _convs(widths, image, batch, loss: bool = True):
    """The convolutions' graph, returning the mean of their output (``loss``) or the output itself."""
    layers = [torch.nn.Conv2d(a, b, 3, padding=1) for a, b in zip(widths, widths[1:])]
    model = torch.nn.Sequential(*[m for conv in layers for m in (conv, torch.nn.ReLU())])
    return _traced(model, torch.randn(batch, widths[0], image, image), loss), layers


def _traced(model, x, loss: bool = False):
    """The aten graph of ``model(x)`` (its mean with ``loss``), its parameters among the inputs."""

    def run(params, x):
        out = torch.func.functional_call(model, params, (x,))
        return out.mean() if loss else out

    return make_fx(run, tracing_mode="fake")(dict(model.named_parameters()), x)


def test_activation_and_weight_bytes_of_the_convolutions():
    graph, layers = _convs((3, 16, 32), image=32, batch=8)
    activations, weights = convolution_bytes(graph)
    assert weights == sum(conv.weight.numel() * 4 for conv in layers)
    assert activations == 8 * 32 * 32 * 4 * ((3 + 16) + (16 + 32))


def test_channels_last_where_the_activations_outweigh_the_weights():
    narrow, _ = _convs((3, 16, 32), image=32, batch=8)  # activations 75x the weights
    wide, _ = _convs((128, 128, 128), image=8, batch=2)  # 0.1x
    assert channels_last_pays(narrow) is True
    assert channels_last_pays(wide) is False
    activations, weights = convolution_bytes(wide)
    assert activations < CHANNELS_LAST_FROM * weights


def test_no_convolutions_leaves_inductors_choice():
    mlp = _traced(torch.nn.Linear(8, 8), torch.randn(4, 8))
    assert channels_last_pays(mlp) is None


def test_a_grouped_convolutions_activations_do_not_count_its_weight_does():
    depthwise = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
    graph = _traced(depthwise, torch.randn(8, 16, 32, 32))
    assert convolution_bytes(graph) == (0, depthwise.weight.numel() * 4)
    assert channels_last_pays(graph) is False


def test_symbolic_sizes_keep_the_graphs_layout():
    model = torch.nn.Conv2d(3, 16, 3, padding=1)

    def run(params, x):
        return torch.func.functional_call(model, params, (x,))

    graph = make_fx(run, tracing_mode="symbolic")(dict(model.named_parameters()), torch.randn(8, 3, 32, 32))
    assert channels_last_pays(graph) is False


def test_a_graph_returning_a_feature_map_keeps_its_layout():
    """Channels-last with a 4-d output was predicted 30% under (docs/CONCEPTS.md): not chosen."""
    graph, _ = _convs((3, 16, 32), image=32, batch=8, loss=False)  # activations 75x the weights
    assert channels_last_pays(graph) is False
