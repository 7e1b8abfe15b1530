"""One plan on every rank: the ranks of a distributed job compare their plans and follow rank 0's.

Ranks compile the same graphs and, since plans are deterministic, choose the
same plans. Should they not (another torch build, a rank-dependent size), they
would recompute different values and, where collectives sit in the graph, issue
different collectives: PyTorch had to broadcast rank 0's recompute decision
for that reason. So when ``torch.distributed`` is initialised with more than
one rank, each graph fxremat plans is checked at compile time:

- rank 0 publishes its plan (the kept values' names) in the process group's
  key-value store under the digest of the graph and the options it was planned
  with, and never waits;
- every other rank reads rank 0's entry for the same digest: equal plans go on;
  a different plan is replaced by rank 0's, with a warning (once per process;
  later ones are logged). A rank whose graph or options differ from every one
  rank 0 planned (a budget left by graphs that held other amounts on another
  rank) waits ``sync_timeout()`` seconds at most, then keeps its own plan, loudly.

The store, not a collective, carries it: a rank that compiles a graph the
others do not (a recompile on one rank) never blocks the others. Entries are
not counted: the same graph under the same options gives the same plan, so a
later publication of the same digest only repeats the first (counting plans
per rank desynchronised when runtime observations re-planned a graph on one
rank and not the other, and the waiting rank stalled a collective).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from datetime import timedelta

import torch.fx as fx

from ._torch_compat import default_store
from .options import Options
from .plan import fingerprint

__all__ = [
    "graph_digest",
    "agree",
    "distributed_rank",
    "sync_timeout",
    "ENV_SYNC_TIMEOUT",
    "SYNC_TIMEOUT_S",
    "KEY_PREFIX",
]

log = logging.getLogger("fxremat")

# How long a rank waits for rank 0's plan of a graph. Ranks start compiling a graph together
# (after the same collectives); planning times differ by seconds. The wait only runs out when
# rank 0 never plans that graph under those options, and then costs this once per graph: it
# must stay well under the collectives' timeout of the rank waiting for this one.
SYNC_TIMEOUT_S = 60.0
ENV_SYNC_TIMEOUT = "FXREMAT_RANK_SYNC_TIMEOUT"
KEY_PREFIX = "fxremat/plan/"

_warned = False


def sync_timeout() -> float:
    """Seconds a rank waits for rank 0's plan (``FXREMAT_RANK_SYNC_TIMEOUT``, default 60)."""
    raw = os.environ.get(ENV_SYNC_TIMEOUT)
    if raw is None:
        return SYNC_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{ENV_SYNC_TIMEOUT}={raw!r} must be a positive number of seconds (default {SYNC_TIMEOUT_S:g})"
        )
    return value


def distributed_rank() -> int | None:
    """This process's rank in a distributed job of more than one process, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_rank()


def graph_digest(joint: fx.GraphModule, options: Options) -> str:
    """A hash of the joint graph (names, ops, targets, shapes, dtypes) and the options that shape its plan."""
    digest = hashlib.sha256(options.key().encode())
    for node in joint.graph.nodes:
        val = node.meta.get("val")
        shape = tuple(val.shape) if hasattr(val, "shape") else None
        digest.update(f"{node.name}|{node.op}|{node.target}|{shape}|{getattr(val, 'dtype', None)}\n".encode())
    return digest.hexdigest()


def agree(digest: str, kept: tuple[str, ...], where: str) -> tuple[str, ...] | None:
    """Compare this rank's plan of a graph with rank 0's.

    Args:
        digest: ``graph_digest`` of the graph.
        kept: names of the values this rank's plan keeps, in graph order.
        where: the graph's name, for messages.

    Returns:
        Rank 0's kept names when they differ from ``kept`` (the caller adopts
        them); None when they agree, on rank 0, outside a distributed job, or
        when rank 0 published no plan for this graph in time.
    """
    rank = distributed_rank()
    if rank is None:
        return None
    key = f"{KEY_PREFIX}{digest}"
    store = default_store()
    if rank == 0:
        store.set(key, json.dumps(list(kept)))
        return None
    timeout = sync_timeout()
    try:
        store.wait([key], timedelta(seconds=timeout))
        theirs = tuple(json.loads(store.get(key)))
    except Exception as exc:  # noqa: BLE001 - a store timeout or a lost store: keep this rank's plan, loudly
        warnings.warn(
            f"fxremat {where}: rank {rank} found no plan from rank 0 for this graph within {timeout:g} s "
            f"({type(exc).__name__}); the ranks compiled different graphs, or rank 0 failed planning it. "
            f"This rank keeps its own plan (set {ENV_SYNC_TIMEOUT} to wait longer).",
            stacklevel=2,
        )
        return None
    if theirs == tuple(kept):
        return None
    global _warned
    message = (
        f"fxremat {where}: rank {rank} planned a different kept set than rank 0 ({len(kept)} values, "
        f"fingerprint {fingerprint(kept)}, against {len(theirs)}, {fingerprint(theirs)}); following rank 0's plan "
        "so that every rank recomputes the same values"
    )
    if not _warned:
        _warned = True
        warnings.warn(message, stacklevel=2)
    else:
        log.warning(message)
    return theirs
