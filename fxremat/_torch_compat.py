"""Every private torch access fxremat makes, each with the reason it is needed.

Supported torch: ``SUPPORTED_TORCH`` below (tested on 2.13.0); pyproject.toml
pins the same range. When torch moves one of these names, this is the only
file to change, and no other module may touch a private torch name (a test
checks it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "SUPPORTED_TORCH",
    "DYNAMO_LINEAR",
    "torch_version_ok",
    "aot_autograd",
    "compile_fx",
    "CustomPartitionerFn",
    "functorch_config",
    "inductor_config",
    "no_autograd_cache",
    "keyed_by_program",
    "dynamo_context_now",
    "compiler_config_digest",
    "prepare_joint",
    "classify_nodes",
    "default_partition",
    "min_cut_partition",
    "extract_programs",
    "is_sym_node",
    "EventType",
    "FakeTensorMode",
    "FakeTensor",
    "BoxedCodeGen",
    "ShortenTraceback",
    "disable_current_modes",
    "inductor_lowering",
    "inductor_kernel_args",
    "inductor_graph_lowering",
    "inductor_program_events",
    "returning_inputs_as_given",
    "lays_out_convolutions",
    "tree_leaves",
    "tree_map",
    "OpOverload",
    "is_op_overload",
    "op_schema",
    "profiler_is_enabled",
    "default_store",
    "StorageWeakRef",
    "fsdp_groups",
    "FsdpGroup",
    "current_autograd_node",
    "engine_runs_node",
    "backward_keeps_graph",
    "has_grad_hooks",
    "compile_context_now",
    "copy_dynamo_graph",
    "trace_through_logging_function",
]

# The torch releases fxremat is tested with, as (major, minor) bounds: >=2.13, <2.15.
SUPPORTED_TORCH = ((2, 13), (2, 15))

# AOTAutograd: traces the joint forward+backward graph and calls our partitioner.
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

# The hook through which Inductor calls a custom partitioner (uuid keys its cache).
from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: E402

# Inductor's config: tests patch its post-fusion hook to compare buffers with the plan.
from torch._inductor import config as inductor_config  # noqa: E402

# functorch's config: `activation_memory_budget` for the reference benchmarks, `cse`.
from torch._functorch import config as functorch_config  # noqa: E402

# Inductor's compile entry point (forward/backward compilers, joint passes, decompositions).
from torch._inductor import compile_fx  # noqa: E402

# PyTorch's own partitioner: joint-graph classification, fw/bw extraction, RNG
# functionalization and tag handling we reuse instead of re-deriving edge cases.
from torch._functorch import partitioners as _partitioners  # noqa: E402

# Symbolic-int nodes in fx graphs (sizes under dynamic shapes) are saved, not decided.
from torch.fx.experimental.proxy_tensor import is_sym_node  # noqa: E402

# CSE as the stock partitioner runs it; getitems moved next to their producer.
from torch._functorch.compile_utils import fx_graph_cse as _fx_graph_cse, raise_getitems as _raise_getitems  # noqa: E402

# CPU memory measurement: the profiler's allocation events.
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

# Tests record the in-place reuses Inductor's scheduler decides (KernelArgs.make_inplace).
from torch._inductor.codegen.common import KernelArgs as inductor_kernel_args  # noqa: E402

# Tests read which buffers Inductor's scheduler fused away (GraphLowering.removed_buffers).
from torch._inductor.graph import GraphLowering as inductor_graph_lowering  # noqa: E402

# Leaves of nested outputs and inputs (lists, tuples, dicts, HF ModelOutput), and mapping them.
from torch.utils._pytree import tree_leaves, tree_map  # noqa: E402

# Dynamo records nn.Linear's call as the C binding torch._C._nn.linear (F.linear is that same
# object): the target the loss-chunking pass looks for in Dynamo's graph.
DYNAMO_LINEAR = torch._C._nn.linear

# A weak reference to a tensor's storage (C++ weak pointer): whether a graph's outputs are still
# alive when the tensors the graph returned were replaced by views (FSDP2 wraps layer outputs).
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

# fx codegen whose forward takes a list it may clear, so inputs die at last use.
from torch.fx.graph import _BoxedCodeGen as BoxedCodeGen  # noqa: E402


def torch_version_ok() -> bool:
    """True when the running torch is inside ``SUPPORTED_TORCH``."""
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    low, high = SUPPORTED_TORCH
    return low <= major_minor < high


def no_autograd_cache():
    """AOTAutograd's cache would serve a partitioned graph without calling the partitioner
    (no Plan to inspect); with it off the joint graph is re-planned."""
    return functorch_config.patch(enable_autograd_cache=False)


class _PlannedProgram(CustomPartitionerFn):
    """Stands in for fxremat's partitioner while Inductor compiles a program it made (never called)."""

    def __call__(self, gm, joint_inputs, **kwargs):
        raise RuntimeError("fxremat: _PlannedProgram only keys Inductor's FX graph cache; it partitions nothing")

    def uuid(self) -> str:
        # Part of the cache key: the fusion rule fxremat compiles under (``fusion_memory_at_hints``) too.
        return (
            "fxremat: a planned program, whose forward returns the inputs it saves as given, fused with "
            "symbolic sizes at their hints"
        )


def keyed_by_program():
    """Inductor keys its FX graph cache on ``custom_partitioner_fn``'s uuid even when it compiles a
    program the partitioner already made; keyed on one constant instead, a program a re-plan left
    unchanged is a hit. Not None (plain ``torch.compile``'s key): its forward of the same program
    returns channels-last copies of the weights it saves (``returning_inputs_as_given``)."""
    return inductor_config.patch(custom_partitioner_fn=_PlannedProgram())


# Inductor's FX graph cache reads the shape environment of Dynamo's TracingContext (torch._guards):
# a graph compiled again after a step, outside it, bypasses the cache ("No shape env").
def dynamo_context_now():
    """A factory of context managers that re-enter, later, the tracing context Dynamo compiles the
    current frame in; None outside one."""
    import copy

    from torch._guards import TracingContext, tracing

    context = TracingContext.try_get()
    if context is None or context.fake_mode is None:
        return None

    def reenter():
        # DDPOptimizer splits one Dynamo graph into buckets that share this context and counts their
        # forward compiles in it (``ddp_optimizer_ctx``); a re-plan is not one of its buckets, and a
        # lazy backward compiled in the shared context would pop a bucket that is not there ("expected
        # same # of fw and bw compiles"). So a re-plan gets a shallow copy without that counter, and
        # what its compile writes there (``fw_metadata``) stays out of the buckets' context.
        own = copy.copy(context)
        own.ddp_optimizer_ctx = None
        return tracing(own)

    return reenter


# Inductor's and AOTAutograd's settings change the programs a plan is judged on (private config modules).
def compiler_config_digest(ignoring: tuple[str, ...] = ()) -> str:
    """A hash of Inductor's and AOTAutograd's current settings (for the plan cache's key); ``ignoring``:
    Inductor settings left out (the partitioner, for a program already partitioned)."""
    import hashlib
    import json

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(map(repr, value))  # set order follows the hash seed; sorted, it does not
        if callable(getattr(value, "uuid", None)):
            return repr(value.uuid())  # custom graph passes and partitioners name their version so
        text = repr(value)
        # An object's default repr holds its address, new in every process: its class stands for it.
        return type(value).__qualname__ if " at 0x" in text else text

    inductor = {k: v for k, v in inductor_config.save_config_portable().items() if k not in ignoring}
    settings = {"inductor": inductor, "aot": functorch_config.save_config_portable()}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=plain).encode()).hexdigest()


def prepare_joint(joint: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
    """The stock partitioner's preparation: DCE, CSE, checkpoint-tag clean-up, forced saves.

    Returns:
        The prepared joint graph, and whether a user checkpoint region asks to
        recompute random ops (their RNG state must then be functionalized).
    """
    joint.graph.eliminate_dead_code()
    joint.recompile()
    if functorch_config.cse:
        joint.graph = _fx_graph_cse(joint.graph)
        joint.recompile()
    recomputes_rng = False
    if _partitioners.has_recomputable_ops(joint):
        recomputes_rng = _partitioners.has_recomputable_rng_ops(joint)
        joint = _partitioners.cleanup_recompute_tags(joint, is_default_partition=False)
    if not functorch_config.unsafe_allow_optimization_of_collectives:
        _partitioners.force_save_collectives(joint)
    _partitioners.force_save_effectful_ops(joint)
    _partitioners.force_save_bw_mutation_src(joint)
    return joint, recomputes_rng


def classify_nodes(joint: torch.fx.GraphModule, static_lifetime_input_indices: list[int], num_fwd_outputs: int):
    """PyTorch's split of the joint graph's nodes: required forward / backward nodes, static inputs."""
    return _partitioners.classify_nodes(joint, static_lifetime_input_indices, num_fwd_outputs)


def default_partition(joint, joint_inputs, num_fwd_outputs: int, static_lifetime_input_indices: list[int], info):
    """PyTorch's default partition, for graphs with nothing to plan (no backward)."""
    return _partitioners.default_partition(
        joint,
        joint_inputs,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
        static_lifetime_input_nodes=info.static_lifetime_input_nodes,
    )


# PyTorch's min-cut partitioner: the fallback (on_error="fallback") and verify's reference.
min_cut_partition = _partitioners.min_cut_rematerialization_partition


def extract_programs(
    joint, saved: list, saved_sym: list, *, num_fwd_outputs: int, static_lifetime_input_nodes, recomputes_rng: bool
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Split ``joint`` into the forward and backward programs that save ``saved`` + ``saved_sym``.

    PyTorch's own extraction handles symbolic sizes, RNG seeds, opaque objects
    and backward state; the backward is then put in the order the autograd
    engine would run it (recomputation just before its first use), getitems
    next to their producers, and graph-safe RNG threaded through both.
    """
    fw, bw = _partitioners._extract_fwd_bwd_modules(
        joint,
        saved,
        saved_sym_nodes=saved_sym,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=static_lifetime_input_nodes,
    )
    if recomputes_rng:
        fw, bw = _partitioners.functionalize_rng_ops(joint, fw, bw, len(saved_sym))
    bw = _partitioners.reordering_to_mimic_autograd_engine(bw)
    fw, bw = _raise_getitems(fw), _raise_getitems(bw)
    fw = _partitioners.thread_graphsafe_rng_from_hops(fw, is_backward=False)
    bw = _partitioners.thread_graphsafe_rng_from_hops(bw, is_backward=True)
    return fw, bw


# ------------------------------------------------------------ graph breaks (graph_breaks.py)


# Dynamo breaks the graph at every logging.Logger method call, unless the function is in its config's
# `ignore_logging_functions` (a private module; its hint for this break names that set).
def trace_through_logging_function(function: Callable[..., object]) -> bool:
    """Let Dynamo trace a call of the logging function ``function`` as a no-op instead of breaking the
    graph there; True when it was not let through before."""
    ignored = torch._dynamo.config.ignore_logging_functions
    if function in ignored:
        return False
    ignored.add(function)
    return True


# ------------------------------------------------------------ op targets and the profiler (passes/)

from typing import Any, TypeGuard  # noqa: E402

# Aten/prims op overloads are the targets whose schema and tags passes read; the class lives in private torch._ops.
OpOverload = torch._ops.OpOverload


# The class test on fx targets, so no pass names torch._ops itself.
def is_op_overload(target: object) -> TypeGuard[OpOverload]:
    """True when an fx ``call_function`` target is an op overload (``torch.ops.aten.mm.default``)."""
    return isinstance(target, torch._ops.OpOverload)


# Alias and mutation info of an op's arguments and returns is only reachable through its private `_schema`.
def op_schema(target: object) -> Any:
    """The op's ``FunctionSchema`` (arguments, returns, alias info), or None for a target without one."""
    return getattr(target, "_schema", None)


# Profiler sessions do not nest; whether one is running is only the private flag `_is_profiler_enabled`.
def profiler_is_enabled() -> bool:
    """Whether a torch profiler session is running in this process."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


# Inductor's layout optimisation is its private config flag `layout_optimization` (patched per graph by fxremat's backend).
def lays_out_convolutions() -> bool:
    """Whether Inductor's layout optimisation is on in the settings of the compile now running
    (channels-last convolutions on CPU with oneDNN, ``GraphLowering.decide_layout_opt``)."""
    return bool(inductor_config.layout_optimization)


def returning_inputs_as_given(gm: torch.fx.GraphModule) -> None:
    """Mark the forward's outputs that are its own inputs as user-visible, so Inductor returns them as given.

    Inductor's layout optimisation (on by default where a graph has convolutions) lays a
    convolution's input and weight out channels-last, and when the forward also returns that
    input for the backward (a weight, the batch) it returns the channels-last copy in its place:
    one more copy of every convolution weight alive from forward to backward (timm resnet18:
    +35 MB on 84 MB). A user-visible output keeps the strides it had in the graph
    (``GraphLowering.run_node``), so the convolution copies its input for itself and frees it.
    Private: Inductor reads the ``user_visible_output_idxs`` and ``original_output_strides``
    metadata of the output node, which ``compile_fx`` writes just before its inner compile.
    """
    out = gm.graph.output_node()
    if "original_output_strides" not in out.meta:
        compile_fx.record_original_output_strides(gm)
    values = _returned(out)
    visible = set(out.meta.get("user_visible_output_idxs", ()))
    visible |= {i for i, v in enumerate(values) if isinstance(v, torch.fx.Node) and v.op == "placeholder"}
    out.meta["user_visible_output_idxs"] = sorted(visible)


# Inductor's fusion heuristic for peak memory (Scheduler.can_fusion_increase_peak_memory, private)
# gives up on a buffer of symbolic size and fuses: a dynamic graph's chunked loss then made two chunks'
# logits at once (torch 2.13: ``int()`` of the size fails, "Fallback is to fuse").
@contextlib.contextmanager
def fusion_memory_at_hints():
    """Inside the block, Inductor's "can this fusion raise the peak" asks symbolic sizes at their hints.

    Where every size is an int the answer is Inductor's own; where one is symbolic, Inductor
    fuses unconditionally and this asks the same question (the single-user inputs both kernels
    read, which the fusion keeps alive, against 32 times the memory traffic it saves) at the hints.
    """
    from torch._inductor.codegen.wrapper import buffer_reuse_key
    from torch._inductor.scheduler import Scheduler
    from torch._inductor.virtualized import V

    own = Scheduler.can_fusion_increase_peak_memory
    if getattr(own, "at_hints", False):
        yield  # already inside (a dry lowering within a compile): one layer asks
        return

    def single_user_inputs(scheduler, node) -> list:
        found = []
        for dep in node.read_writes.reads:
            buf = scheduler.name_to_buf.get(dep.name)
            if buf and len(buf.users) == 1 and buf.node.has_tensor_output():
                found.append(buf.node)
        return found

    def symbolic(scheduler) -> bool:
        """Whether the graph being scheduled has an input of symbolic size (asked once per scheduler)."""
        known = getattr(scheduler, "_fxremat_symbolic", None)
        if known is None:
            known = any(
                getattr(size, "free_symbols", None)
                for value in V.graph.graph_inputs.values()
                if hasattr(value, "get_size")
                for size in value.get_size()
            )
            scheduler._fxremat_symbolic = known
        return known

    def at_hints(self, node1, node2) -> bool:
        if own(self, node1, node2):
            return True
        if not symbolic(self):
            return False
        left = {buffer_reuse_key(buf): buf for buf in single_user_inputs(self, node1)}
        right = {buffer_reuse_key(buf) for buf in single_user_inputs(self, node2)}
        common = {key: buf for key, buf in left.items() if key in right}
        if all(str(key[2]).isdigit() for key in common):
            return False  # every size an int: Inductor's own answer stands
        overhead = sum(
            int(V.graph.sizevars.optimization_hint(V.graph.get_allocation_storage_size(buf), fallback=0))
            for buf in common.values()
        )
        return overhead > 32 * int(
            V.graph.sizevars.optimization_hint(self.score_fusion_memory(node1, node2), fallback=0)
        )

    at_hints.at_hints = True  # type: ignore[attr-defined]
    Scheduler.can_fusion_increase_peak_memory = at_hints  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler.can_fusion_increase_peak_memory = own  # type: ignore[method-assign]


def fusing_at_hints(compile_inner: Callable) -> Callable:
    """``compile_inner`` run inside ``fusion_memory_at_hints`` (a lazily compiled backward too)."""

    def compile_at_hints(*args, **kwargs):
        with fusion_memory_at_hints():
            return compile_inner(*args, **kwargs)

    return compile_at_hints


# ------------------------------------------------------------ Inductor's CPU check (backend.py, dry lowerings)

# Inductor checks once per process which vector instruction sets the C++ compiler can build and load
# (``cpu_vec_isa.valid_vec_isa_list``: a small library compiled and loaded per set; 8.5 s with an empty
# kernel cache on a 2-core machine, 8.2 s of it in the compiler's processes). A dry lowering writes scalar
# kernels (``cpp.simdlen = 1``), which take no vector set whatever the answer, so it does not ask: before,
# the first one in this process and the first in each forked child asked at once (benchmark Llama, no
# budget: its first forward lowered in 6.3 s here and 8.4 s in a child, the next ones in 0.9-1.6 s). The
# real compile asks; ``check_cpu_isa_ahead`` starts the check in a thread when planning starts, beside it.
_CPU_ISA_CHECK: list = []


@contextlib.contextmanager
def _no_cpu_isa_check():
    """Inside the block, Inductor's C++ backend picks what ``cpp.simdlen = 1`` picks (no vector ISA)
    without checking the CPU."""
    from torch._inductor import cpu_vec_isa

    own = cpu_vec_isa.pick_vec_isa
    cpu_vec_isa.pick_vec_isa = lambda: cpu_vec_isa.invalid_vec_isa
    try:
        yield
    finally:
        cpu_vec_isa.pick_vec_isa = own


def check_cpu_isa_ahead() -> None:
    """Start Inductor's check of the CPU's vector instruction sets in a thread, once per process, unless
    it is done; ``cpu_isa_checked`` waits for it."""
    import threading

    from torch._inductor import cpu_vec_isa

    if _CPU_ISA_CHECK or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return

    def check() -> None:
        try:
            cpu_vec_isa.valid_vec_isa_list()
        except Exception:  # noqa: BLE001 - the compile that needs the answer asks again and reports the failure
            pass

    thread = threading.Thread(target=check, name="fxremat-cpu-isa-check", daemon=True)
    _CPU_ISA_CHECK.append(thread)
    thread.start()


def cpu_isa_checked() -> None:
    """Wait for the check ``check_cpu_isa_ahead`` started, if any (before a compile that generates C++ kernels
    asks for its answer: asked meanwhile, it would run again beside it)."""
    if _CPU_ISA_CHECK:
        _CPU_ISA_CHECK[0].join()


def inductor_program_events(
    gm: torch.fx.GraphModule,
    *,
    is_backward: bool,
    donated: list[int] | None = None,
    strides: dict[int, tuple[int, ...]] | None = None,
    vectorized: bool = False,
) -> list[tuple]:
    """The memory events of the program Inductor generates for ``gm``, in its order.

    Runs what ``compile_fx_inner`` runs up to the Python wrapper (post-grad passes,
    lowering, fusion, Inductor's memory-aware reordering, in-place and buffer-reuse
    planning) on a copy of ``gm`` under its fake mode, and stops before any kernel is
    compiled. The wrapper's planned lines are the allocations the step will make:
    reading them is the one way to see Inductor's own buffers (the reason for the
    private imports here).

    Args:
        gm: a planned forward or backward, as AOTAutograd hands it to Inductor.
        is_backward: which of the two it is.
        donated: positions of the backward's placeholders AOTAutograd donates
            (saved tensors no forward input, user output or gradient shares):
            Inductor may write into them in place.
        strides: placeholder position -> the strides its value arrives with, where they
            differ from the graph's: a backward's saved values as the compiled forward laid
            them out (AOTAutograd compiles the backward with those).
        vectorized: generate the C++ kernels' vectorized variants as the real
            compile does. Off by default: on CPU they are 30-60% of a lowering's
            time and change no buffer, no reuse and no order (the same events on
            every program of the zoo and the benchmarks; ``tests/
            test_inductor_memory.py`` checks it).

    Returns:
        Plain tuples, in program order:
        ``("alloc", name, bytes)``, ``("free", name)``, ``("reuse", old, new)``
        (``new`` takes ``old``'s memory), ``("alias", old, new)`` (``new`` is a view
        of ``old``), ``("hold", tuple, part)`` (a kernel's returned tuple holds one of its
        outputs until the tuple is freed), ``("kernel", origin_names)`` (a kernel runs; its fx origins), for an
        extern kernel ``("kernel", origin_names, (fx node, input strides))``: the node it
        runs and the strides Inductor gives its tensor inputs, and for a node Inductor's own
        passes made (no node of ``gm``: ``mm`` and ``add`` folded into ``addmm``)
        ``(fx node, input strides, passes.oprun.OpCall)``: the call, to measure its workspace;
        last, ``("outputs", strides)``: the strides of each output as the program returns it
        (None where it is not a tensor).
    """
    import copy

    from torch._guards import detect_fake_mode
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper as w
    from torch._inductor.debug import DebugContext
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V

    from .passes.oprun import op_call

    gm = copy.deepcopy(gm)
    given = {n.name for n in gm.graph.nodes}
    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = detect_fake_mode(vals)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    view_to_reshape(gm)
    if strides:
        # As compile_fx_inner does: the values' strides propagated again from the inputs' (a
        # convolution's weight gradient comes out channels-last from channels-last activations).
        with fake_mode:
            vals = [v.as_strided(v.size(), strides[i]) if i in strides else v for i, v in enumerate(vals)]
        compile_fx.fake_tensor_prop(gm, vals)
    out = gm.graph.output_node()
    if is_backward and inductor_config.bw_outputs_user_visible:
        # compile_fx_backward's marking: the gradients keep the strides they were traced with.
        out.meta["user_visible_output_idxs"] = [i for i, v in enumerate(_returned(out)) if isinstance(v, torch.fx.Node)]
    out.meta.pop("original_output_strides", None)
    if not is_backward:
        returning_inputs_as_given(gm)
    else:
        compile_fx.record_original_output_strides(gm)
    events: list[tuple] = []

    def nbytes(node) -> int:
        layout = node.get_output_spec() if hasattr(node, "get_output_spec") else node.layout
        if isinstance(layout, (ir.NoneLayout, ir.MultiOutputLayout)) or node.get_inputs_that_alias_output():
            return 0
        size = V.graph.sizevars.optimization_hint(V.graph.get_allocation_storage_size(node), fallback=0)
        return int(size) * get_dtype_size(node.get_dtype())

    def origins(node) -> tuple[str, ...]:
        return tuple(sorted(o.name for o in getattr(node, "origins", ()) or ()))

    def extern(node) -> tuple | None:
        """(the fx node an extern kernel runs, the strides of its tensor inputs as Inductor lays them out),
        and its call when Inductor's passes made that node."""
        op = getattr(node, "op_overload", None)
        origin = getattr(node, "origin_node", None) or next(
            (o for o in getattr(node, "origins", ()) or () if getattr(o, "target", None) is op), None
        )
        if origin is None:
            return None
        try:
            strides = tuple(
                tuple(int(V.graph.sizevars.optimization_hint(s, fallback=0)) for s in x.get_stride())
                for x in node.inputs
            )
        except (AttributeError, NotImplementedError, TypeError):
            return None
        if origin.name in given:
            return origin.name, strides
        return origin.name, strides, op_call(origin, strides)

    # `cpp.simdlen = 1` matches no vector ISA, so the C++ backend writes scalar kernels only.
    scalar = {} if vectorized else {"cpp.simdlen": 1}
    with (
        DebugContext(),
        V.set_fake_mode(fake_mode),
        torch.no_grad(),
        inductor_config.patch(scalar),
        contextlib.nullcontext() if vectorized else _no_cpu_isa_check(),
        fusion_memory_at_hints(),
    ):
        compile_fx._recursive_post_grad_passes(gm, is_inference=False)
        graph = inductor_graph_lowering(
            gm, example_inputs=vals, shape_env=fake_mode.shape_env, is_inference=False, is_backward=is_backward
        )
        if is_backward:
            graph.bw_donated_idxs = list(donated or [])
        with V.set_graph_handler(graph), V.set_extern_kernel_nodes([]):
            graph.run(*vals)
            graph.codegen()
            # Tuple-returning kernel -> the outputs taken straight out of its tuple.
            parts: dict[str, list] = {}
            for buf in graph.buffers:
                if isinstance(buf, ir.MultiOutput) and buf.inputs and isinstance(buf.inputs[0], ir.Buffer):
                    if isinstance(buf.inputs[0].layout, ir.MultiOutputLayout):
                        parts.setdefault(buf.inputs[0].get_name(), []).append(buf)
            made: set[str] = set()
            for line in graph.wrapper_code.lines:
                if isinstance(line, w.ReuseLine):
                    events.append(("reuse", line.node.get_name(), line.reused_as.get_name()))
                elif isinstance(line, w.ReinterpretLine):
                    events.append(("alias", line.node.get_name(), line.reused_as.get_name()))
                elif isinstance(line, w.AllocateLine):
                    events.append(("alloc", line.node.get_name(), nbytes(line.node)))
                elif isinstance(line, w.FreeIfNotReusedLine):
                    if not line.is_reused:
                        events.append(("free", line.node.get_name()))
                elif isinstance(line, w.FreeLine):
                    events.append(("free", line.node.get_name()))
                elif isinstance(line, w.ExternKernelAllocLine):
                    events.append(("alloc", line.node.get_name(), nbytes(line.node)))
                    events.append(("kernel", origins(line.node), extern(line.node)))
                    # A kernel returning a tuple makes all its outputs now; the tuple holds
                    # them until it is deleted, often kernels after the `buf[i]` lines.
                    for part in parts.get(line.node.get_name(), ()):
                        events.append(("alloc", part.get_name(), nbytes(part)))
                        events.append(("hold", line.node.get_name(), part.get_name()))
                        made.add(part.get_name())
                elif isinstance(line, w.MultiOutputLine):
                    if line.result_name not in made:
                        events.append(("alloc", line.result_name, nbytes(graph.get_buffer(line.result_name))))
                elif isinstance(line, w.ExternKernelOutLine):
                    events.append(("kernel", origins(line.node), extern(line.node)))
                elif isinstance(line, w.KernelCallLine):
                    events.append(("kernel", ()))
            events.append(("outputs", tuple(_output_strides(result) for result in graph.graph_outputs or ())))
    return events


def _returned(out: torch.fx.Node) -> tuple:
    """The values an output node returns, in order (Inductor's reading of its arguments)."""
    return tuple(out.args[0]) if isinstance(out.args[0], (tuple, list)) else tuple(out.args)


def _output_strides(result) -> tuple[int, ...] | None:
    """The strides a lowered graph output (Inductor IR) is returned with; None when it is no tensor."""
    from torch._inductor.virtualized import V

    try:
        if not result.has_tensor_output():
            return None
        return tuple(int(V.graph.sizevars.optimization_hint(x, fallback=0)) for x in result.get_layout().stride)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def default_store():
    """The default process group's key-value store: rank 0's plan reaches the other ranks
    through it without a collective, so a rank that plans alone never blocks the others."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


class FsdpGroup(NamedTuple):
    """One FSDP2 parameter group (a ``fully_shard`` unit) of the model a graph belongs to."""

    nbytes: int
    """Bytes of its unsharded parameters."""
    resharded: bool
    """Freed after the forward and all-gathered again for the backward (every group but the root, by default)."""
    shapes: tuple
    """Its parameters' shapes and dtypes: groups of identical layers have equal ones."""
    in_graph: bool
    """Some of its unsharded parameters are inputs of the graph."""


def fsdp_groups(tensors) -> list[FsdpGroup]:
    """Every FSDP2 parameter group of the model whose unsharded parameters are among ``tensors``
    (a compiled graph's inputs).

    FSDP2 keeps its per-module state in the composable-API registry, and the root's
    context lists every state of its tree; its hooks all-gather and free the
    unsharded parameters outside the compiled graphs, so the budget must leave room
    for them. Empty when no input is an FSDP2 parameter.
    """
    import sys

    if "torch.distributed.fsdp" not in sys.modules:
        return []
    from torch.distributed import _composable_state
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    wanted = {id(t) for t in tensors}

    def holds_inputs(group) -> bool:
        return any(id(getattr(p, "_unsharded_param", None)) in wanted for p in group.fsdp_params)

    for ref in list(_composable_state._module_state_mapping.values()):
        state = ref() if callable(ref) else ref
        if not isinstance(state, FSDPState):
            continue
        group = state._fsdp_param_group
        if group is None or not holds_inputs(group):
            continue
        states = state._state_ctx.all_states or [state]
        out = []
        for each in {id(s): s for s in states}.values():
            g = each._fsdp_param_group
            if g is not None:
                dtypes = [p.param_dtype or p.sharded_param.dtype for p in g.fsdp_params]
                out.append(
                    FsdpGroup(
                        sum(p._orig_size.numel() * d.itemsize for p, d in zip(g.fsdp_params, dtypes)),
                        g.post_forward_mesh_info is not None,
                        tuple((tuple(p._orig_size), str(d)) for p, d in zip(g.fsdp_params, dtypes)),
                        holds_inputs(g),
                    )
                )
        return out
    return []


# ------------------------------------------------------------ handing gradients over (grads.py)


# The node whose backward is running: its next_functions lead to each input's AccumulateGrad.
def current_autograd_node():
    """The autograd node the engine is running on this thread (None outside a backward)."""
    return torch._C._current_autograd_node()


# Whether this backward will run a node: `.backward(inputs=...)` and `autograd.grad` skip some.
def engine_runs_node(node) -> bool:
    """Whether the running backward will call ``node`` (an AccumulateGrad: whether it fills ``.grad``)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        # Raised for a leaf's node under torch.autograd.grad: its gradient is captured, not accumulated.
        return False


# retain_graph / create_graph of the running backward (create_graph implies keeping the graph).
def backward_keeps_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True`` or ``create_graph=True``)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


# Python hooks on a leaf live in its private `_backward_hooks` and `_post_accumulate_grad_hooks`.
def has_grad_hooks(param: torch.Tensor) -> bool:
    """Whether Python code registered a gradient hook or a post-accumulate-grad hook on ``param``."""
    return bool(getattr(param, "_backward_hooks", None)) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


# A backward is compiled inside AOTAutograd's tracing and compile contexts and Inductor's patched
# config (torch._guards, private config modules); compiling another version of it later needs them again.
def compile_context_now():
    """A context manager factory that re-enters, later, the compile contexts and compiler settings in
    effect now (inside a backward's compile): for compiling a variant of that backward on demand."""
    import contextlib

    from torch._guards import CompileContext, TracingContext, compile_context, tracing

    tracing_context, compiling = TracingContext.try_get(), CompileContext.try_get()
    inductor, aot = inductor_config.get_config_copy(), functorch_config.get_config_copy()

    @contextlib.contextmanager
    def again():
        with (
            tracing(tracing_context),
            compile_context(compiling),
            inductor_config.patch(inductor),
            functorch_config.patch(aot),
            torch._C._DisableAutocast(),
        ):
            yield

    return again


# The names of Dynamo's size controls fxremat's messages tell users to use or change (private modules).
MARK_DYNAMIC = "torch._dynamo.mark_dynamic"
MAYBE_MARK_DYNAMIC = "torch._dynamo.maybe_mark_dynamic"
RECOMPILE_LIMIT = "torch._dynamo.config.recompile_limit"


# torch._dynamo.mark_dynamic records the dimensions on the tensor itself, in a private attribute.
def marked_dynamic(t: torch.Tensor) -> set[int]:
    """The dimensions of ``t`` marked with ``torch._dynamo.mark_dynamic`` (not ``maybe_mark_dynamic``):
    Dynamo raises if a compile fixes one of them."""
    return set(getattr(t, "_dynamo_dynamic_indices", ()) or ())


# Which compile of its frame Dynamo is making (torch._guards' compile id) and how many it makes before it
# runs the frame uncompiled (torch._dynamo.config.recompile_limit): both private.
def frame_compiles() -> tuple[int, int] | None:
    """(how many times Dynamo has compiled the frame it is compiling now, this compile counted; how many
    it compiles at most before running new inputs of it without compiling them); None outside a compile."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_compile_id is None:
        return None
    return compile_id.frame_compile_id + 1, int(torch._dynamo.config.recompile_limit)


# Dynamo tells AOTAutograd which inputs are parameters (static_input_indices) through the private
# `_param_name_to_source` of its GraphModule and `_dynamo_source` of each placeholder, which
# copy.deepcopy drops: a copy compiled again (a re-plan, the chunked loss) would have none.
def copy_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of Dynamo's graph that AOTAutograd still reads as Dynamo's (its parameters known)."""
    import copy

    out = copy.deepcopy(gm)
    if hasattr(gm, "_param_name_to_source"):
        out._param_name_to_source = gm._param_name_to_source
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), out.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return out
