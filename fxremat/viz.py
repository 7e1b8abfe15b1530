"""Figures of a Plan: the memory timeline, the joint graph, the Pareto front.

Optional: matplotlib (PNG figures) is imported lazily, inside the functions
that draw, and is only needed for them (``pip install fxremat[viz]``). The
Graphviz DOT text is written without any dependency; ``graph.svg`` is rendered
when Graphviz's ``dot`` binary is on the PATH. Figures are drawn on an Agg
canvas (no window, no global pyplot state) and written only to the paths
given.

Example:
    >>> plan = fxremat.explain(model, x, budget="2GiB")
    >>> fxremat.viz.save_figures(plan, "plan/")
    [PosixPath('plan/graph.dot'), PosixPath('plan/graph.svg'), PosixPath('plan/timeline.png')]
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .budget import format_bytes

__all__ = [
    "timeline_png",
    "plan_dot",
    "plan_svg",
    "save_figures",
    "pareto_png",
    "COLLAPSE_THRESHOLD",
    "ROLE_COLORS",
]

logger = logging.getLogger(__name__)

# Above this many nodes Graphviz's dot layout takes minutes and the picture is
# unreadable (a GPT-2 block's joint graph has ~400 nodes), so plan_dot draws one
# box per module instead unless full=True.
COLLAPSE_THRESHOLD = 300

# Fill colour per NodeRecord.role: kept green, recomputed orange, other forward
# light grey, backward light blue (ColorBrewer-like pastel tones).
ROLE_COLORS = {
    "kept": "#7fc97f",
    "recomputed": "#fdae61",
    "forward": "#e0e0e0",
    "backward": "#add8e6",
}

# Seconds before rendering an SVG is given up: dot on a few thousand nodes
# finishes well within this; longer means the layout will not finish usefully.
SVG_TIMEOUT_SECONDS = 120

# Size of the PNG figures, inches at DPI (1000 x 500 pixels).
FIGSIZE = (10.0, 5.0)
DPI = 100

# Reference series colours: matplotlib's tab palette without the blue of the plan.
_REFERENCE_COLORS = ("tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")

_INSTALL_HINT = "pip install fxremat[viz]"


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _figure():
    """A matplotlib Figure on an Agg canvas, or ImportError with the install hint."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"fxremat.viz needs matplotlib to draw PNG figures: {_INSTALL_HINT}") from exc
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit (name, bytes) that fits values up to ``largest``."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1


def _normalised(phases: Sequence[str]) -> list[float]:
    """x of each step: forward steps on [0, 1), backward steps on [1, 2)."""
    n_fw = sum(1 for p in phases if p == "forward")
    n_bw = len(phases) - n_fw
    xs, i_fw, i_bw = [], 0, 0
    for phase in phases:
        if phase == "forward":
            xs.append(i_fw / n_fw)
            i_fw += 1
        else:
            xs.append(1.0 + i_bw / n_bw)
            i_bw += 1
    return xs


def _with_end(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """Repeat the last value at the end of its phase, so the last step of a steps-post line shows."""
    if not xs:
        return xs, ys
    return xs + [2.0 if xs[-1] >= 1.0 else 1.0], ys + [ys[-1]]


def _reference_steps(series) -> list[tuple[str, int]]:
    """(phase, live bytes) steps from a Plan, (phase, bytes) pairs or (name, phase, bytes) triples."""
    steps = getattr(series, "timeline", series)
    return [(str(step[-2]), int(step[-1])) for step in steps]


def _dot_quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dot_label(*lines: str) -> str:
    """A quoted DOT label with one line per argument (Graphviz's ``\\n``)."""
    return '"' + "\\n".join(str(line).replace("\\", "\\\\").replace('"', '\\"') for line in lines) + '"'


# ---------------------------------------------------------------------------
# Memory timeline
# ---------------------------------------------------------------------------


def timeline_png(plan, path: str | os.PathLike, *, measured=None, references: Mapping | None = None) -> Path:
    """Draw the predicted live memory of a plan's forward then backward.

    The x axis is normalised so series of different lengths line up: each
    series' forward steps fill [0, 1) and its backward steps [1, 2). The
    budget is a dashed horizontal line; the forward/backward boundary a
    dotted vertical one.

    Args:
        plan: a ``fxremat.Plan`` (uses ``timeline``, ``budget``, ``predicted_peak``, ``graph``).
        path: the PNG file to write (its folder must exist).
        measured: optional ``fxremat.Measurement``; its ``timeline`` of
            (seconds since step start, live bytes) is stretched over [0, 2]
            by time (so its forward/backward boundary is only approximately at 1).
        references: optional name -> series drawn for comparison, e.g.
            ``{"save_all": ..., "save_inputs": ...}``; a series is a sequence of
            (phase, live bytes), of (name, phase, live bytes), or a Plan.

    Returns:
        ``path`` as a Path.

    Raises:
        ImportError: matplotlib is missing (install hint in the message).

    Example:
        >>> timeline_png(plan, "timeline.png", references={"save_all": save_all_plan})
        PosixPath('timeline.png')
    """
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    steps = [(phase, int(live)) for _name, phase, live in plan.timeline]
    refs = {name: _reference_steps(series) for name, series in (references or {}).items()}
    meas = [(float(t), int(b)) for t, b in measured.timeline] if measured is not None else []
    values = [b for _, b in steps] + [b for s in refs.values() for _, b in s] + [b for _, b in meas]
    values += [plan.predicted_peak] + ([plan.budget] if plan.budget is not None else [])
    unit, scale = _byte_unit(max(values, default=0))

    for k, (name, series) in enumerate(refs.items()):
        xs, ys = _with_end(_normalised([p for p, _ in series]), [b / scale for _, b in series])
        color = _REFERENCE_COLORS[k % len(_REFERENCE_COLORS)]
        ax.plot(xs, ys, drawstyle="steps-post", color=color, linewidth=1, alpha=0.8, label=name)
    if meas:
        end = meas[-1][0] or 1.0
        label = f"measured (time-scaled), peak {format_bytes(max(b for _, b in meas))}"
        ax.plot(
            [2 * t / end for t, _ in meas],
            [b / scale for _, b in meas],
            color="black",
            linewidth=1,
            alpha=0.7,
            label=label,
        )
    if steps:
        xs = _normalised([p for p, _ in steps])
        ys = [b / scale for _, b in steps]
        ax.plot(
            *_with_end(xs, ys),
            drawstyle="steps-post",
            color="tab:blue",
            linewidth=2,
            label=f"{plan.solver} (predicted)",
        )
        top = max(range(len(ys)), key=ys.__getitem__)
        ax.plot([xs[top]], [ys[top]], "o", color="tab:blue")
        ax.annotate(
            f"peak {format_bytes(steps[top][1])}\n{plan.timeline[top][0]}",
            (xs[top], ys[top]),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize=8,
        )
    else:
        ax.text(0.5, 0.5, "no timeline recorded", transform=ax.transAxes, ha="center")
    if plan.budget is not None:
        ax.axhline(plan.budget / scale, color="tab:red", linestyle="--", label=f"budget {format_bytes(plan.budget)}")
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlim(0, 2)
    ax.set_xticks([0, 0.5, 1, 1.5, 2], ["forward", "", "backward", "", "end"])
    # Headroom above the highest value for the peak's annotation.
    ax.set_ylim(0, max(max(values, default=0) / scale, 1e-9) * 1.15)
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_xlabel("step (forward and backward each normalised to unit length)")
    budget = "none" if plan.budget is None else format_bytes(plan.budget)
    chunked = "".join(f"\nloss in chunks: {line.split(' (')[0]}" for line in plan.chunked)
    ax.set_title(f"{plan.graph}: predicted peak {format_bytes(plan.predicted_peak)}, budget {budget}{chunked}")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    logger.debug("wrote %s", out)
    return out


# ---------------------------------------------------------------------------
# Joint graph (Graphviz DOT)
# ---------------------------------------------------------------------------


def plan_dot(plan, path: str | os.PathLike, *, full: bool = False) -> Path:
    """Write the plan's joint graph as Graphviz DOT text.

    Kept values are green, recomputed orange, other forward nodes light grey
    and backward nodes light blue (``ROLE_COLORS``); each node shows its op
    and bytes. A graph of more than ``COLLAPSE_THRESHOLD`` nodes is collapsed
    to one box per module path (forward and backward apart), with the kept and
    recomputed counts and bytes of each, unless ``full=True``.

    Args:
        plan: a ``fxremat.Plan`` (uses ``nodes``, ``graph``, ``budget``, ``predicted_peak``).
        path: the ``.dot`` file to write (its folder must exist).
        full: draw every node even in a large graph.

    Returns:
        ``path`` as a Path.

    Example:
        >>> plan_dot(plan, "graph.dot")
        PosixPath('graph.dot')
    """
    nodes = plan.nodes
    collapse = len(nodes) > COLLAPSE_THRESHOLD and not full
    budget = "none" if plan.budget is None else format_bytes(plan.budget)
    title = f"{plan.graph}: {len(nodes)} nodes, budget {budget}, predicted peak {format_bytes(plan.predicted_peak)}" + (
        " (collapsed per module; full=True draws every node)" if collapse else ""
    )
    legend = "green: kept   orange: recomputed   grey: forward   blue: backward"
    lines = [
        f"digraph {_dot_quote(plan.graph)} {{",
        f"  graph [label={_dot_label(title, legend)}, labelloc=t, fontsize=12];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
        '  edge [color="#777777", arrowsize=0.6];',
    ]
    lines += _module_dot(nodes) if collapse else _node_dot(nodes)
    lines.append("}")
    out = Path(path)
    out.write_text("\n".join(lines) + "\n")
    logger.debug("wrote %s (%d nodes, collapsed=%s)", out, len(nodes), collapse)
    return out


def _node_dot(nodes) -> list[str]:
    names = {n.name for n in nodes}
    lines = []
    for n in nodes:
        color = ROLE_COLORS.get(n.role, "white")
        label = _dot_label(n.name, n.op, format_bytes(n.nbytes), n.module or "<top>")
        lines.append(f'  {_dot_quote(n.name)} [label={label}, fillcolor="{color}", tooltip={_dot_quote(n.role)}];')
    for n in nodes:
        for src in dict.fromkeys(n.inputs):  # graph inputs are not among the nodes
            if src in names:
                lines.append(f"  {_dot_quote(src)} -> {_dot_quote(n.name)};")
    return lines


def _module_dot(nodes) -> list[str]:
    """One box per (module path, side), in order of first appearance."""
    groups: dict[tuple[str, str], dict] = {}
    group_of = {}
    for n in nodes:
        side = "backward" if n.role == "backward" else "forward"
        key = (n.module or "<top>", side)
        g = groups.setdefault(key, {"kept": [0, 0], "recomputed": [0, 0], "forward": [0, 0], "backward": [0, 0]})
        tally = g.setdefault(n.role, [0, 0])
        tally[0] += 1
        tally[1] += n.nbytes
        group_of[n.name] = key
    ids = {key: f"m{i}" for i, key in enumerate(groups)}
    lines = []
    for key, g in groups.items():
        module, side = key
        rows = [module if side == "forward" else f"{module} (backward)"]
        for role in ("kept", "recomputed"):
            if g[role][0]:
                rows.append(f"{role} {g[role][0]}: {format_bytes(g[role][1])}")
        other = g["forward"][0] + g["backward"][0]
        if other:
            rows.append(f"{other} other node" + ("s" if other > 1 else ""))
        kept_b, rec_b = g["kept"][1], g["recomputed"][1]
        if side == "backward":
            fill = ROLE_COLORS["backward"]
        elif g["kept"][0] and g["recomputed"][0]:
            share = kept_b / (kept_b + rec_b) if kept_b + rec_b else 0.5
            share = min(max(share, 0.05), 0.95)  # both stripes stay visible
            fill = f"{ROLE_COLORS['kept']};{share:.2f}:{ROLE_COLORS['recomputed']}"
        elif g["kept"][0] or g["recomputed"][0]:
            fill = ROLE_COLORS["kept" if g["kept"][0] else "recomputed"]
        else:
            fill = ROLE_COLORS["forward"]
        style = ', style="striped"' if ";" in fill else ""
        lines.append(f'  {ids[key]} [label={_dot_label(*rows)}, fillcolor="{fill}"{style}];')
    edges: dict[tuple[str, str], int] = {}
    for n in nodes:
        dst = group_of[n.name]
        for src in n.inputs:
            if src in group_of and group_of[src] != dst:
                pair = (ids[group_of[src]], ids[dst])
                edges[pair] = edges.get(pair, 0) + 1
    for (a, b), count in edges.items():
        lines.append(f"  {a} -> {b}" + (f' [label="{count}", fontsize=8];' if count > 1 else ";"))
    return lines


def plan_svg(dot_path: str | os.PathLike) -> Path | None:
    """Render a DOT file to SVG next to it with Graphviz's ``dot``.

    Args:
        dot_path: a ``.dot`` file, e.g. from :func:`plan_dot`.

    Returns:
        The ``.svg`` path, or None when the ``dot`` binary is not installed.

    Raises:
        RuntimeError: ``dot`` failed or ran longer than ``SVG_TIMEOUT_SECONDS``
            (its error output is in the message).

    Example:
        >>> plan_svg(plan_dot(plan, "graph.dot"))
        PosixPath('graph.svg')
    """
    exe = shutil.which("dot")
    if exe is None:
        logger.info("Graphviz 'dot' not found; no SVG (install graphviz to render %s)", dot_path)
        return None
    src = Path(dot_path)
    out = src.with_suffix(".svg")
    try:
        subprocess.run(
            [exe, "-Tsvg", str(src), "-o", str(out)],
            check=True,
            capture_output=True,
            text=True,
            timeout=SVG_TIMEOUT_SECONDS,
        )
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"Graphviz dot failed on {src} (exit {exc.returncode}): {exc.stderr.strip()}") from exc
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"Graphviz dot took over {SVG_TIMEOUT_SECONDS} s on {src}; draw it collapsed (full=False)"
        ) from exc
    logger.debug("wrote %s", out)
    return out


# ---------------------------------------------------------------------------
# All figures of a plan
# ---------------------------------------------------------------------------


def save_figures(
    plan, directory: str | os.PathLike, *, measured=None, references: Mapping | None = None, full: bool = False
) -> list[Path]:
    """Write ``graph.dot``, ``graph.svg`` (when Graphviz is installed) and ``timeline.png``.

    ``Plan.save`` calls this, so it never fails for a missing optional
    dependency: without Graphviz there is no SVG, without matplotlib no PNG
    (a warning gives the install hint). A failing ``dot`` is a warning too.

    Args:
        plan: a ``fxremat.Plan``.
        directory: where to write (created if missing).
        measured, references: passed to :func:`timeline_png`.
        full: passed to :func:`plan_dot`.

    Returns:
        The files written, in that order.

    Example:
        >>> save_figures(plan, "plan/")
        [PosixPath('plan/graph.dot'), PosixPath('plan/graph.svg'), PosixPath('plan/timeline.png')]
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [plan_dot(plan, out / "graph.dot", full=full)]
    try:
        svg = plan_svg(written[0])
    except RuntimeError as exc:
        warnings.warn(f"fxremat: no graph.svg: {exc}", stacklevel=2)
        svg = None
    if svg is not None:
        written.append(svg)
    try:
        written.append(timeline_png(plan, out / "timeline.png", measured=measured, references=references))
    except ImportError as exc:
        warnings.warn(f"fxremat: no timeline.png: {exc}", stacklevel=2)
    return written


# ---------------------------------------------------------------------------
# Pareto front
# ---------------------------------------------------------------------------


def pareto_png(points: Iterable, path: str | os.PathLike) -> Path:
    """Draw estimated recompute time against predicted peak, one marker per point.

    The staircase joins the points no other point beats on both axes (less
    or equal peak and less time).

    Args:
        points: objects with ``predicted_peak`` (bytes) and
            ``recompute_seconds``, and optionally ``budget`` (bytes), such as
            the ``ParetoPoint`` list ``fxremat.pareto`` returns.
        path: the PNG file to write (its folder must exist).

    Returns:
        ``path`` as a Path.

    Raises:
        ImportError: matplotlib is missing (install hint in the message).

    Example:
        >>> pareto_png(fxremat.pareto(model, x, points=8), "pareto.png")
        PosixPath('pareto.png')
    """
    pts = sorted(points, key=lambda p: (p.predicted_peak, p.recompute_seconds))
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    unit, scale = _byte_unit(max((p.predicted_peak for p in pts), default=0))
    slowest = max((p.recompute_seconds for p in pts), default=0.0)
    t_unit, t_scale = ("s", 1.0) if slowest >= 1 else ("ms", 1e-3)
    front: list = []
    for p in pts:
        if not front or p.recompute_seconds < front[-1].recompute_seconds:
            front.append(p)
    if front:
        ax.plot(
            [p.predicted_peak / scale for p in front],
            [p.recompute_seconds / t_scale for p in front],
            drawstyle="steps-post",
            color="tab:blue",
            label="front",
        )
    ax.plot(
        [p.predicted_peak / scale for p in pts],
        [p.recompute_seconds / t_scale for p in pts],
        "o",
        color="tab:blue",
        label="plans",
    )
    # Budget labels on each marker while they stay legible.
    if len(pts) <= 12:
        for p in pts:
            budget = getattr(p, "budget", None)
            if budget is not None:
                ax.annotate(
                    f"budget {format_bytes(budget)}",
                    (p.predicted_peak / scale, p.recompute_seconds / t_scale),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
    if not pts:
        ax.text(0.5, 0.5, "no points", transform=ax.transAxes, ha="center")
    ax.set_xlabel(f"predicted peak ({unit})")
    ax.set_ylabel(f"estimated recompute time ({t_unit})")
    ax.set_title(f"memory / recompute trade-off ({len(pts)} plans)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    logger.debug("wrote %s", out)
    return out
