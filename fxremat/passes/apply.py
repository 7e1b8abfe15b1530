"""Lower a decision to the forward and backward GraphModules that will run.

The kept values become the forward's extra outputs (saved for backward);
everything else the backward needs is recomputed inside it. PyTorch's own
``_extract_fwd_bwd_modules`` does the split (it handles symbolic sizes, RNG
seeds, opaque objects and backward state); the backward is then reordered so
each recomputed value runs just before its first use and dies after its last.
"""

from __future__ import annotations

import torch.fx as fx

from .._torch_compat import extract_programs, is_sym_node

__all__ = ["apply_decision"]


def apply_decision(
    joint: fx.GraphModule,
    kept: list[fx.Node],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_nodes,
    recomputes_rng: bool,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split ``joint`` into forward and backward programs that keep ``kept``.

    Args:
        joint: the joint graph, after the stock tag passes.
        kept: forward nodes saved for the backward (tensors and symbolic ints).
        num_fwd_outputs: how many joint outputs belong to the forward.
        static_lifetime_input_nodes: inputs Inductor treats as static (parameters).
        recomputes_rng: the joint graph has random ops tagged for recomputation by a
            user checkpoint region; their RNG state is then functionalized so the
            backward replays exactly the forward's randomness.

    Returns:
        (forward, backward) GraphModules.
    """
    return extract_programs(
        joint,
        [n for n in kept if not is_sym_node(n)],
        [n for n in kept if is_sym_node(n)],
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=static_lifetime_input_nodes,
        recomputes_rng=recomputes_rng,
    )
