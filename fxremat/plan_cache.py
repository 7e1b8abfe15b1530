"""Plans kept on disk: a graph planned in one run is not searched and lowered again in the next.

Choosing a plan solves the problem several times and, under Inductor, lowers each
candidate's programs through Inductor to judge them: seconds on small models,
minutes on large ones (docs/PLANNING_TIME.md). A job launched again with the same
model, sizes and options, or every rank of a job on one host, would pay that again
for the same answer: the planner's search is bounded by rounds, not time, so its
plan is a function of what it is given.

``key`` hashes all of that: the joint graph (every node's name, op, target,
arguments, shape, stride and dtype), the options that shape a plan, the
measured op workspace, the hardware profile, PyTorch's compiler configuration
and the versions of torch and of fxremat's own source. ``load`` and ``store``
keep one small JSON file per key in ``folder()`` (default ``~/.cache/fxremat/plans``);
``FXREMAT_PLAN_CACHE=0`` turns the cache off.

An entry is the outcome of choosing, never code: the kept values' names, the
solver's labels and notes, and the peaks the candidates were judged at (or the
least peak of a refused budget). On a hit the planner lowers the kept set to
its programs again (cheap) and checks the solver model's peak for it against the
stored one; it skips the search and the dry lowerings. A file that cannot be
read, or does not match, is a miss and is written again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
import torch.fx as fx

from ._torch_compat import compiler_config_digest
from .options import Options
from .passes.opinfo import size_hint

__all__ = ["enabled", "folder", "key", "load", "store", "source_digest", "FORMAT"]

FORMAT = 1
"""Version of the entry layout; part of every key, so a new layout never reads an old file."""

log = logging.getLogger("fxremat")


def enabled() -> bool:
    """Whether plans are read from and written to disk (``FXREMAT_PLAN_CACHE=0`` turns it off)."""
    return os.environ.get("FXREMAT_PLAN_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def folder() -> Path:
    """Where the entries live: ``$FXREMAT_PLAN_CACHE_DIR``, else ``$FXREMAT_CACHE_DIR/plans``, by default
    ``~/.cache/fxremat/plans``."""
    if os.environ.get("FXREMAT_PLAN_CACHE_DIR"):
        return Path(os.environ["FXREMAT_PLAN_CACHE_DIR"])
    return Path(os.environ.get("FXREMAT_CACHE_DIR", Path.home() / ".cache" / "fxremat")) / "plans"


@functools.cache
def source_digest() -> str:
    """A hash of fxremat's own source: a new version never reuses an old plan (here or in Inductor's caches)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        shape, stride = (",".join(_size(d) for d in sizes) for sizes in (value.shape, value.stride()))
        return f"T({shape})({stride}){value.dtype}{value.device.type}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    if isinstance(value, torch.SymInt):
        return _size(value)
    return repr(value) if isinstance(value, (int, float, bool, str, type(None))) else type(value).__name__


def _size(d) -> str:
    """A size as written, and a symbolic one at its hint too: a dynamic graph is planned at its hints."""
    return f"{d}={size_hint(d)}" if isinstance(d, torch.SymInt) else str(d)


def _arg(value) -> str:
    if isinstance(value, fx.Node):
        return "%" + value.name
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_arg(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_arg(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def key(
    joint: fx.GraphModule,
    options: Options,
    *,
    num_fwd_outputs: int,
    static_inputs: list[str],
    scratch: dict[str, int],
    hardware: object,
) -> str:
    """The cache key of planning ``joint`` with ``options`` (a hex digest).

    Args:
        joint: the joint graph as the planner sees it (after ``prepare_joint``).
        options: validated options (``Options.key``: every field that changes a plan).
        num_fwd_outputs: how many joint outputs belong to the forward.
        static_inputs: names of the inputs with static lifetime (parameters).
        scratch: measured op workspace by node name.
        hardware: the hardware profile the costs came from (its ``repr`` is hashed).
    """
    digest = hashlib.sha256()
    for part in (
        f"format {FORMAT}",
        torch.__version__,
        source_digest(),
        compiler_config_digest(),
        options.key(),
        repr(hardware),
        f"{num_fwd_outputs} {sorted(static_inputs)}",
        json.dumps(sorted(scratch.items())),
    ):
        digest.update(part.encode() + b"\n")
    for node in joint.graph.nodes:
        line = f"{node.name}|{node.op}|{node.target}|{_arg(node.args)}|{_arg(node.kwargs)}|"
        digest.update((line + _describe(node.meta.get("val")) + "\n").encode())
    return digest.hexdigest()


def load(digest: str) -> dict | None:
    """The entry stored under ``digest``, or None (no entry, or one that cannot be read)."""
    path = folder() / f"{digest}.json"
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.info("fxremat: ignoring an unreadable plan cache entry %s (%s)", path, e)
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        log.info("fxremat: ignoring a plan cache entry of another layout: %s", path)
        return None
    return entry


def store(digest: str, entry: dict) -> None:
    """Write ``entry`` under ``digest`` atomically; a cache that cannot be written only logs why."""
    path = folder() / f"{digest}.json"
    text = json.dumps({"format": FORMAT, **entry}, indent=1)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except OSError as e:
        log.info("fxremat: could not write the plan cache entry %s (%s)", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
