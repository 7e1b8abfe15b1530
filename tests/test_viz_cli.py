"""Figures (fxremat.viz) and the command line (fxremat.cli) on hand-made plans."""

from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap
from types import SimpleNamespace

import pytest

import fxremat
from fxremat import cli, viz
from fxremat.measure import Measurement
from fxremat.plan import NodeRecord, Plan, ValueRecord

pytest.importorskip("matplotlib")
pydot = pytest.importorskip("pydot")
from matplotlib.image import imread  # noqa: E402

MiB = 2**20


def make_plan(num_layers: int = 3, per_layer: int = 4, budget: int | None = 6 * MiB) -> Plan:
    """A chain of ``num_layers`` modules with ``per_layer`` forward nodes each, then its backward."""
    roles = ("kept", "recomputed", "forward")
    nodes, timeline, prev, live = [], [], None, 0
    for layer in range(num_layers):
        for j in range(per_layer):
            name = f"fw_{layer}_{j}"
            role = roles[j % 3]
            nodes.append(NodeRecord(name, "aten.mm", f"layers.{layer}", role, MiB, (prev,) if prev else ("x",)))
            live += MiB if role == "kept" else 0
            timeline.append((name, "forward", live + MiB))
            prev = name
    for layer in reversed(range(num_layers)):
        for j in range(per_layer):
            name = f"bw_{layer}_{j}"
            nodes.append(NodeRecord(name, "aten.mm", f"layers.{layer}", "backward", MiB, (prev, f"fw_{layer}_{j}")))
            live = max(live - MiB // 2, 0)
            timeline.append((name, "backward", live + 2 * MiB))
            prev = name
    kept = tuple(ValueRecord(n.name, n.op, n.module, n.nbytes, 10, 1e-6) for n in nodes if n.role == "kept")
    recomputed = tuple(ValueRecord(n.name, n.op, n.module, n.nbytes, 10, 1e-6) for n in nodes if n.role == "recomputed")
    return Plan(
        graph="graph 0",
        budget=budget,
        predicted_peak=max(b for *_, b in timeline),
        saved_bytes=len(kept) * MiB,
        recompute_flops=10 * len(recomputed),
        recompute_seconds=1e-6 * len(recomputed),
        solver="mincut",
        solve_seconds=0.01,
        kept=kept,
        recomputed=recomputed,
        timeline=tuple(timeline),
        nodes=tuple(nodes),
        num_nodes=len(nodes),
    )


def dot_nodes(text: str) -> list:
    (graph,) = pydot.graph_from_dot_data(text)
    return [n for n in graph.get_nodes() if n.get_name().strip('"') not in ("node", "edge", "graph")]


# ---------------------------------------------------------------------------
# viz
# ---------------------------------------------------------------------------


def test_timeline_png_size_and_overlays(tmp_path):
    plan = make_plan()
    measured = Measurement(
        peak_bytes=5 * MiB,
        step_seconds=0.1,
        all_step_seconds=(0.1,),
        timeline=((0.0, 0), (0.05, 5 * MiB), (0.1, MiB)),
        device="cpu",
    )
    references = {
        "save_all": [("forward", 2 * MiB), ("forward", 8 * MiB), ("backward", 4 * MiB)],
        "save_inputs": make_plan(budget=None),
    }
    path = viz.timeline_png(plan, tmp_path / "t.png", measured=measured, references=references)
    image = imread(path)
    assert image.shape[:2] == (viz.DPI * viz.FIGSIZE[1], viz.DPI * viz.FIGSIZE[0])
    assert image.std() > 0  # not blank


def test_timeline_png_without_budget_or_timeline(tmp_path):
    plan = make_plan(budget=None)
    assert imread(viz.timeline_png(plan, tmp_path / "a.png")).shape[0] > 0
    empty = Plan("graph 1", None, 0, 0, 0, 0.0, "save_all", 0.0, (), ())
    assert imread(viz.timeline_png(empty, tmp_path / "b.png")).shape[0] > 0


def test_plan_dot_small_graph_has_roles_and_edges(tmp_path):
    plan = make_plan()
    text = viz.plan_dot(plan, tmp_path / "g.dot").read_text()
    nodes = dot_nodes(text)
    assert len(nodes) == len(plan.nodes)
    for role in ("kept", "recomputed", "forward", "backward"):
        assert viz.ROLE_COLORS[role] in text
    (graph,) = pydot.graph_from_dot_data(text)
    # a chain through every node, plus one edge per backward node from its forward node; "x" is no node
    assert len(graph.get_edges()) == (len(plan.nodes) - 1) + len(plan.nodes) // 2
    assert "aten.mm" in text and "1.00 MiB" in text


def test_plan_dot_collapses_large_graphs_unless_full(tmp_path):
    plan = make_plan(num_layers=40, per_layer=4)  # 320 nodes > COLLAPSE_THRESHOLD
    assert len(plan.nodes) > viz.COLLAPSE_THRESHOLD
    text = viz.plan_dot(plan, tmp_path / "c.dot").read_text()
    nodes = dot_nodes(text)
    assert len(nodes) == 2 * 40  # per module, forward and backward boxes
    assert "kept 2: 2.00 MiB" in text and "recomputed 1: 1.00 MiB" in text
    assert viz.ROLE_COLORS["kept"] in text and viz.ROLE_COLORS["recomputed"] in text
    full = viz.plan_dot(plan, tmp_path / "f.dot", full=True).read_text()
    assert len(re.findall(r"^\s+\"[fb]w_\d+_\d+\" \[", full, flags=re.M)) == len(plan.nodes)


def test_plan_dot_quotes_odd_names(tmp_path):
    node = NodeRecord('we"ird\\name', "aten.add", "a.b", "kept", 4, ())
    plan = Plan('graph "q"', None, 4, 4, 0, 0.0, "save_all", 0.0, (), (), nodes=(node,))
    assert len(dot_nodes(viz.plan_dot(plan, tmp_path / "q.dot").read_text())) == 1


def test_plan_svg_none_without_graphviz(tmp_path, monkeypatch):
    dot = viz.plan_dot(make_plan(), tmp_path / "g.dot")
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    assert viz.plan_svg(dot) is None
    assert not (tmp_path / "g.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
def test_plan_svg_with_graphviz(tmp_path):
    svg = viz.plan_svg(viz.plan_dot(make_plan(), tmp_path / "g.dot"))
    assert svg == tmp_path / "g.svg" and "<svg" in svg.read_text()


def test_save_figures(tmp_path):
    files = viz.save_figures(make_plan(), tmp_path / "out")
    names = [p.name for p in files]
    expected = ["graph.dot"] + (["graph.svg"] if shutil.which("dot") else []) + ["timeline.png"]
    assert names == expected and all(p.is_file() for p in files)


def test_missing_matplotlib_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install fxremat\[viz\]"):
        viz.timeline_png(make_plan(), tmp_path / "t.png")
    with pytest.warns(UserWarning, match="no timeline.png"):
        files = viz.save_figures(make_plan(), tmp_path)
    assert (tmp_path / "graph.dot") in files and not (tmp_path / "timeline.png").exists()


def test_pareto_png(tmp_path):
    points = [
        SimpleNamespace(budget=b * MiB, predicted_peak=b * MiB, recompute_seconds=t)
        for b, t in ((8, 0.0), (6, 0.002), (5, 0.003), (4, 0.010), (7, 0.004))
    ]
    assert imread(viz.pareto_png(points, tmp_path / "p.png")).shape[:2] == (500, 1000)


# ---------------------------------------------------------------------------
# cli
# ---------------------------------------------------------------------------


FACTORY = """
import torch
import torch.nn as nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return model, (torch.randn(16, 32),)
"""


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "tiny_factory.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fxremat {fxremat.__version__}"


@pytest.mark.parametrize("command", ["explain", "pareto"])
def test_help(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"fxremat {command} " in out and "MODULE:FACTORY" in out


def test_no_command_is_usage_error(capsys):
    assert cli.main([]) == 2


@pytest.mark.parametrize("budget", ["lots", "0.5", "-1GiB", "0"])
def test_bad_budget(budget, factory_file, capsys):
    assert cli.main(["explain", f"{factory_file}:make", f"--budget={budget}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--budget" in err and "512MiB" in err


def test_bad_target(tmp_path, factory_file, capsys):
    assert cli.main(["explain", "no_colon_here"]) == 2
    assert cli.main(["explain", f"{tmp_path}/missing.py:make"]) == 2
    assert cli.main(["explain", f"{factory_file}:nope"]) == 2
    assert cli.main(["explain", f"{factory_file}:make", "--solver", "magic"]) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 4 and "MODULE:FACTORY" in errs[0] and "no such file" in errs[1] and "'nope'" in errs[2]
    assert "magic" in errs[3]


def test_explain_with_fake_planner(tmp_path, factory_file, monkeypatch, capsys):
    calls = []

    def fake_explain(model, *args, budget=None, **options):
        calls.append((model, args, budget, options))
        return make_plan(budget=budget)

    monkeypatch.setattr(fxremat, "explain", fake_explain, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # progress lines go to a terminal
    monkeypatch.chdir(tmp_path)  # dotted module names resolve from the current directory
    out = tmp_path / "out"
    argv = ["explain", "tiny_factory:make", "--budget", "8MiB", "--inner", "eager", "--out", str(out)]
    assert cli.main(argv) == 0
    ((_, args, budget, options),) = calls
    assert budget == 8 * MiB and options == {"inner": "eager"} and args[0].shape == (16, 32)
    captured = capsys.readouterr()
    assert "planning tiny_factory:make (budget 8.00 MiB)" in captured.err and "planned in" in captured.err
    stdout = captured.out
    assert "predicted peak" in stdout and "graph.dot" in stdout and "plan.json" in stdout
    assert {"plan.txt", "plan.json", "graph.dot", "timeline.png"} <= {p.name for p in out.iterdir()}


def test_pareto_with_fake_planner(tmp_path, factory_file, monkeypatch, capsys):
    front = [
        SimpleNamespace(budget=b * MiB, predicted_peak=b * MiB, recompute_seconds=t, solver="mincut", plan=None)
        for b, t in ((8, 0.0), (6, 0.002), (4, 0.010))
    ]
    seen = {}

    def fake_pareto(model, *args, points=8, **options):
        seen.update(points=points, options=options)
        return front

    monkeypatch.setattr(fxremat, "pareto", fake_pareto, raising=False)
    assert cli.main(["pareto", f"{factory_file}:make", "--points", "3", "--out", str(tmp_path / "o")]) == 0
    assert seen == {"points": 3, "options": {}}
    out = capsys.readouterr().out
    assert "8.00 MiB" in out and "10.000" in out and "mincut" in out
    assert (tmp_path / "o" / "pareto.png").is_file()


def test_explain_end_to_end(tmp_path, factory_file, capsys):
    if not hasattr(fxremat, "explain"):
        pytest.skip("fxremat.explain is not there yet")
    out = tmp_path / "plan"
    assert (
        cli.main(["explain", f"{factory_file}:make", "--budget", "64MiB", "--inner", "eager", "--out", str(out)]) == 0
    )
    assert "predicted peak" in capsys.readouterr().out
    for name in ("plan.txt", "plan.json", "timeline.png", "graph.dot"):
        assert (out / name).is_file(), name
    assert json.loads((out / "plan.json").read_text())["schema"] == "fxremat.plan/1"
    assert dot_nodes((out / "graph.dot").read_text())
