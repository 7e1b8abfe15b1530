"""A zoo model compiled under fxremat and Inductor once, watched by every Inductor hook the
checks against Inductor read (tests/test_fusion.py: the buffers Inductor realizes and the ones
it removes; tests/test_inplace.py: the in-place reuses it makes and the fx nodes behind each
buffer), the observations kept per process.

Both files look at Llama and the transformer at the least budget: one compile and one
measurement (20-40 s each on two cores) serve them all. ``param`` marks a model's tests with one
``xdist_group``, so that ``--dist loadgroup`` (``make test``) runs them on one worker.
"""

from __future__ import annotations

import copy
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fxremat
from fxremat import planner
from fxremat._torch_compat import inductor_config, inductor_graph_lowering, inductor_kernel_args
from fxremat.hardware import get_hardware
from fxremat.passes.cost import annotate
from fxremat.passes.fusion import fused_nodes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import ZOO  # noqa: E402

# Llama with one layer: the same kinds of values counted as fused as with two, in both programs (forward 16
# kinds, backward 19: rotary cos/sin, RMSNorm's pow and mul, the mask's iota/ge/lt/bitwise_and, the loss's
# exp and where...), 31 and 77 values instead of 45 and 126, in 60% of the time; the simulation still
# takes in-place reuses, all of them ones Inductor makes.
SIZES = {"llama": {"num_hidden_layers": 1}}


@dataclass(frozen=True)
class Observed:
    """What one compile of a model showed, the planned forward and backward in that order."""

    fused: list[set[str]]  # per program: the values fxremat counts as fused
    allocated: list[set[str]]  # per program: the fx nodes of the buffers Inductor allocates
    reused: set[str]  # the writers the simulation puts into a buffer that dies under them
    inplace: set[str]  # the fx nodes Inductor computes into a buffer it reuses in place
    plan: fxremat.Plan
    measured: int  # the measured peak, bytes


def param(name: str, *values):
    """``pytest.param(name, *values)`` in the ``xdist_group`` of ``name``'s compile."""
    return pytest.param(name, *values, marks=pytest.mark.xdist_group(f"inductor-{name}"))


_OBSERVED: dict[tuple[str, int | None], Observed] = {}


def observe(name: str, budget: int | None) -> Observed:
    """``_compile_and_observe``, once per model and budget in this process."""
    if (name, budget) not in _OBSERVED:
        _OBSERVED[name, budget] = _compile_and_observe(name, budget)
    return _OBSERVED[name, budget]


def _compile_and_observe(name: str, budget: int | None) -> Observed:
    realized: list[dict[str, str]] = []  # per program: Inductor buffer -> its fx node (origin_node)
    done: list[list[str]] = []  # per program: the buffers Inductor writes in place
    origins: dict[str, set[str]] = {}  # Inductor buffer -> the fx nodes it computes (every program)
    removed: list[set[str]] = []  # per program: buffers the scheduler fused away as kernel-local

    def post_fusion(nodes):
        names: dict[str, str] = {}
        for node in nodes:
            for out in node.get_outputs():
                origins.setdefault(out.get_name(), set()).update(o.name for o in getattr(out.node, "origins", ()))
                origin = getattr(out.node, "origin_node", None)
                if origin is not None:
                    names[out.get_name()] = origin.name
        realized.append(names)
        done.append([])
        return nodes

    make_inplace = inductor_kernel_args.make_inplace

    def record(self, input_name, output_name):
        done[-1].append(output_name)
        return make_inplace(self, input_name, output_name)

    compile_to_module = inductor_graph_lowering.compile_to_module

    def compiled_module(self, *args, **kwargs):
        module = compile_to_module(self, *args, **kwargs)
        removed.append(set(self.removed_buffers))
        return module

    torch._dynamo.reset()
    fxremat.clear_plans()
    base, inputs = ZOO[name](**SIZES.get(name, {}))
    # Gradients returned at the end (hand_over_grads off): only the planned forward and backward are
    # compiled, the last two programs the hooks see.
    compiled = torch.compile(
        copy.deepcopy(base),
        backend=fxremat.backend(budget=budget, on_infeasible="min", inner="inductor", hand_over_grads=False),
    )
    with (
        pytest.MonkeyPatch.context() as patch,
        inductor_config.patch(_post_fusion_custom_pass=post_fusion, fx_graph_cache=False),
        warnings.catch_warnings(),
        planner.watch() as planned,
    ):
        patch.setattr(inductor_kernel_args, "make_inplace", record)
        patch.setattr(inductor_graph_lowering, "compile_to_module", compiled_module)
        warnings.simplefilter("ignore")
        compiled(*inputs).backward()
        measured = fxremat.measure(lambda: compiled(*inputs).backward(), reps=1, warmup=1)
    lowered = planned[-1][1].lowered
    sim = lowered.simulation
    return Observed(
        fused=[
            {n.name for n in fused_nodes(gm.graph, annotate(gm, get_hardware("cpu")))}
            for gm in (lowered.forward, lowered.backward)
        ],
        allocated=[
            {origin for buf, origin in names.items() if buf not in gone}
            for names, gone in zip(realized[-2:], removed[-2:])
        ],
        reused={sim.names[writer] for writer, _ in sim.timeline.reused},
        inplace=set().union(*(origins.get(buf, {buf}) for program in done[-2:] for buf in program)),
        plan=fxremat.plans()[-1],
        measured=measured.peak_bytes,
    )
