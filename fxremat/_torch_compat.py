"""Every private torch import fxremat uses, each with the reason it is needed.

Supported torch: >=2.13,<2.15 (tested on 2.13.0). When torch moves one of
these names, this is the only file to change.
"""

from __future__ import annotations

import torch

__all__ = [
    "SUPPORTED_TORCH",
    "aot_autograd",
    "make_boxed_func",
    "CustomPartitionerFn",
    "inductor_config",
    "functorch_config",
    "compile_fx",
    "partitioners",
    "is_sym_node",
    "raise_getitems",
    "fx_graph_cse",
    "MemoryProfile",
    "Action",
    "EventType",
    "FakeTensorMode",
    "FakeTensor",
    "BoxedCodeGen",
    "ShortenTraceback",
    "disable_current_modes",
    "inductor_lowering",
    "current_compile_id",
    "inductor_kernel_args",
    "inductor_graph_lowering",
]

SUPPORTED_TORCH = (">=2.13", "<2.15")

# AOTAutograd: traces the joint forward+backward graph and calls our partitioner.
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
# Boxed calling convention lets the runtime free inputs (saved tensors) early.
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
# The hook through which Inductor calls a custom partitioner (uuid keys its cache).
from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: E402
# Inductor's config holds `custom_partitioner_fn`, patched per compile.
from torch._inductor import config as inductor_config  # noqa: E402
# functorch's config: `activation_memory_budget` for the reference benchmarks, `cse`.
from torch._functorch import config as functorch_config  # noqa: E402
# Inductor's compile entry point (forward/backward compilers, joint passes, decompositions).
from torch._inductor import compile_fx  # noqa: E402
# PyTorch's own partitioner: joint-graph classification, fw/bw extraction, RNG
# functionalization and tag handling we reuse instead of re-deriving edge cases.
from torch._functorch import partitioners  # noqa: E402
# Symbolic-int nodes in fx graphs (sizes under dynamic shapes) are saved, not decided.
from torch.fx.experimental.proxy_tensor import is_sym_node  # noqa: E402
# Moves getitem nodes next to their producer, as the stock partitioner does.
from torch._functorch.compile_utils import fx_graph_cse, raise_getitems  # noqa: E402
# CPU memory measurement: the profiler's allocation timeline.
from torch.profiler._memory_profiler import Action, MemoryProfile  # noqa: E402
from torch._C._profiler import _EventType as EventType  # noqa: E402
# Dynamo re-raises this exception class unwrapped, so fxremat.BudgetError reaches users as itself.
from torch._dynamo.exc import ShortenTraceback  # noqa: E402
# Planning runs inside AOTAutograd's fake mode; measuring op scratch needs real tensors.
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: E402
# Fake tensors for planning without allocating (explain on meta / large models).
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
# Which aten ops Inductor lowers into generated kernels, and which run as extern or
# fallback kernels that need their inputs materialized (the fusion model of passes/fusion.py).
from torch._inductor import lowering as inductor_lowering  # noqa: E402
# Dynamo's frame id for the graph being compiled: recompiles of one frame are not graph breaks.
from torch._guards import CompileContext  # noqa: E402
current_compile_id = CompileContext.current_compile_id
# Tests record the in-place reuses Inductor's scheduler decides (KernelArgs.make_inplace).
from torch._inductor.codegen.common import KernelArgs as inductor_kernel_args  # noqa: E402
# Tests read which buffers Inductor's scheduler fused away (GraphLowering.removed_buffers).
from torch._inductor.graph import GraphLowering as inductor_graph_lowering  # noqa: E402
# fx codegen whose forward takes a list it may clear, so inputs die at last use.
from torch.fx.graph import _BoxedCodeGen as BoxedCodeGen  # noqa: E402


def torch_version_ok() -> bool:
    """True when the running torch is inside the supported range."""
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return (2, 13) <= major_minor < (2, 15)
