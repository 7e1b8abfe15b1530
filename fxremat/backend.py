"""The torch.compile backend: options, registration, inner compilers.

``torch.compile(model, backend="fxremat", options={...})`` finds
``fxremat_backend`` through the ``torch_dynamo_backends`` entry point, so no
import of fxremat is needed. ``fxremat.backend(budget=...)`` returns the same
backend with options bound, for code that prefers a callable.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from ._torch_compat import (
    BoxedCodeGen,
    CustomPartitionerFn,
    aot_autograd,
    compile_fx,
    functorch_config,
    partitioners,
    torch_version_ok,
)
from .budget import BudgetError
from .options import Options
from .passes.partition import partition
from .plan import plans
from .verify import input_names, verified

__all__ = ["backend", "fxremat_backend", "FxrematPartitioner"]

log = logging.getLogger("fxremat")


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Hash of fxremat's own sources: a new version never reuses an old cached plan."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


class FxrematPartitioner(CustomPartitionerFn):
    """fxremat's partitioner in Inductor's ``custom_partitioner_fn`` slot.

    ``uuid()`` covers every option that changes the plan and fxremat's source,
    so Inductor's FX graph cache never serves a plan made for other options.
    """

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs: Any):
        return _partition_guarded(gm, joint_inputs, self.options, **kwargs)

    def uuid(self) -> str:
        return hashlib.sha256((self.options.key() + _source_hash()).encode()).hexdigest()


def _partition_guarded(gm, joint_inputs, options: Options, **kwargs):
    """Run the partitioner; on an unexpected failure raise with context, or fall back."""
    try:
        return partition(gm, joint_inputs, options=options, **kwargs)
    except BudgetError:
        raise
    except Exception as exc:
        if options.on_error != "fallback":
            raise RuntimeError(
                f"fxremat failed while planning a graph of {len(gm.graph.nodes)} nodes: {type(exc).__name__}: {exc}. "
                "Pass options={'on_error': 'fallback'} to use PyTorch's partitioner for such graphs instead."
            ) from exc
        warnings.warn(
            f"fxremat failed while planning a graph ({type(exc).__name__}: {exc}); "
            "using PyTorch's min-cut partitioner for this graph (on_error='fallback')",
            stacklevel=2,
        )
        kwargs.pop("compiler", None)
        return partitioners.min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def _eager_compiler(gm: fx.GraphModule, example_inputs) -> Callable:
    """Run an fx graph as Python code in the boxed convention (inputs die at last use)."""
    gm.graph.set_codegen(BoxedCodeGen())
    gm.recompile()

    def run(args):
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compile(gm: fx.GraphModule, example_inputs, options: Options):
    if not torch_version_ok():
        warnings.warn(f"fxremat is tested with torch >=2.13,<2.15; this is torch {torch.__version__}", stacklevel=2)
    if not options.verify:
        return _compile_planned(gm, example_inputs, options)
    # The reference gets its own copy: compiling may rewrite the graph in place.
    reference_gm = copy.deepcopy(gm)
    names = input_names(gm)
    count = len(plans())
    compiled = _compile_planned(gm, example_inputs, options)
    where = plans()[-1].graph if len(plans()) > count else "a graph with no backward"
    return verified(compiled, _compile_reference(reference_gm, example_inputs, options), names, where)


def _compile_reference(gm: fx.GraphModule, example_inputs, options: Options):
    """The same graph through the same inner compiler with PyTorch's own (min-cut) partition."""
    if options.inner == "eager":
        return aot_autograd(
            fw_compiler=_eager_compiler,
            bw_compiler=_eager_compiler,
            partition_fn=partitioners.min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    return compile_fx.compile_fx(gm, example_inputs)


def _compile_planned(gm: fx.GraphModule, example_inputs, options: Options):
    partitioner = FxrematPartitioner(options)
    if options.inner == "eager":
        inner = aot_autograd(
            fw_compiler=_eager_compiler,
            bw_compiler=_eager_compiler,
            partition_fn=functools.partial(_partition_guarded, options=options),
            keep_inference_input_mutations=True,
        )
        return inner(gm, example_inputs)
    # AOTAutograd's cache would serve a partitioned graph without calling the partitioner,
    # leaving no Plan to inspect; with it off the joint graph is re-planned (fast) while
    # Inductor's FX graph cache, keyed by the partitioner's uuid, still skips code generation.
    patches: dict[str, object] = {"custom_partitioner_fn": partitioner}
    if options.budget is not None:
        # Layout optimisation inserts channels-last copies of convolution inputs after
        # planning, memory the plan never saw (a CNN measured 1.035x its budget with it).
        patches["layout_optimization"] = False
        # Buffer reuse holds a dead buffer until a later allocation of its size takes it,
        # memory the liveness simulation frees (transformer, least plan: measured 1.07x its
        # prediction with reuse, 0.93x without). In-place reuse of a dying input stays on.
        patches["allow_buffer_reuse"] = False
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx.compile_fx(gm, example_inputs, config_patches=patches)


def fxremat_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """The ``"fxremat"`` backend that ``torch.compile`` finds by name.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: the ``options=`` mapping of ``torch.compile`` (see ``fxremat.Options``).
        mode: ignored (``torch.compile``'s mode presets belong to Inductor).

    Returns:
        The compiled callable.

    Example:
        >>> compiled = torch.compile(model, backend="fxremat", options={"budget": "2GiB", "inner": "eager"})
    """
    return _compile(gm, example_inputs, Options.from_mapping(options))


def backend(budget: int | str | None = None, **options: Any) -> Callable:
    """A torch.compile backend that plans recomputation under ``budget``.

    Args:
        budget: peak bytes of the step's activations, temporaries and gradients:
            an int, a string with a unit (``"2GiB"``, ``"512MiB"``, ``"1.5GB"``),
            or None for the fastest plan. ``FXREMAT_BUDGET`` is read when None
            and the variable is set.
        **options: ``inner`` ("inductor" or "eager"), ``solver``, ``hardware``,
            ``on_infeasible`` ("error" or "min"), ``on_error`` ("raise" or
            "fallback"), ``time_limit``, ``dump_dir``, ``measure_scratch``
            (see ``fxremat.Options``).

    Returns:
        A backend for ``torch.compile(model, backend=...)``.

    Example:
        >>> compiled = torch.compile(model, backend=fxremat.backend(budget="2GiB", inner="eager"))
        >>> compiled(x).sum().backward()
    """
    mapping = dict(options)
    if budget is not None:
        mapping["budget"] = budget
    opts = Options.from_mapping(mapping)

    def fxremat(gm: fx.GraphModule, example_inputs):
        return _compile(gm, example_inputs, opts)

    fxremat.options = opts  # type: ignore[attr-defined]
    return fxremat
