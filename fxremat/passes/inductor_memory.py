"""The step's peak as Inductor will run it: its own programs, buffers and order.

Under ``inner="inductor"`` the programs that run are not the fx graphs the
planner lowers: Inductor fuses pointwise ops into kernels, writes into dying
buffers in place, reuses freed buffers, reorders kernels for memory and adds
layout copies. Rather than imitate those rules, this pass asks Inductor for the
program it would generate for each planned graph (``_torch_compat.
inductor_program_events``: lowering, scheduling and wrapper code, no kernel
compiled) and replays its allocations and frees:

- forward: from the pre-step baseline; its inputs (weights, the batch) are the
  caller's and never freed; what it returns stays alive;
- between: the user outputs are dropped when the caller released them; the
  gradient inputs (tangents) are allocated, and a scalar loss's seed gradient;
- backward: starts holding the saved storages and the tangents; a saved storage
  is freed when the program deletes its last reference, unless a forward input
  or a still-held user output shares it; the gradients it returns stay alive.
  It is lowered for the strides its saved values arrive with, the ones the
  forward's program returns them at (channels-last activations where Inductor
  lays convolutions out so), as AOTAutograd compiles it; a gradient it returns at
  other strides than its parameter's is copied by autograd into ``.grad``'s
  layout, one more such gradient alive at its end.

Measured op workspace (``passes/scratch.py``) is added while the kernel that
needs it runs.

A dry lowering costs 1-3 s on a transformer of four layers, and one compile asks
for the same program many times: a refused budget and the least plan it runs, the
plan for the outputs dropped after the first step, the one for steps with
``.grad`` allocated and the backward that hands gradients over share most of their
forwards and some backwards. ``program_events`` keeps the events of the last
``PROGRAMS_KEPT`` programs lowered in the process, by a fingerprint of the graph
(its code, every value's shape, strides and dtype, which inputs share storage,
the donated inputs and Inductor's settings).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .._torch_compat import FakeTensor, compiler_config_digest, inductor_program_events
from .forked import Child, fork_call, workers
from .hand_over import GRAD_INPUT
from .invariants import outputs_of, storage_of
from .opinfo import size_hint, strides_hint
from .problem import is_tangent
from .simulate import seed_gradient_bytes

__all__ = [
    "InductorStep",
    "predict_step",
    "program_events",
    "start_lowering",
    "stop_lowering",
    "donated_inputs",
    "forget_programs",
    "replay",
    "PROGRAMS_KEPT",
]

log = logging.getLogger(__name__)

# Programs whose events are kept (``program_events``): a compile of a four-layer
# transformer asks for 20-30, most of them more than once; each is a few thousand
# small tuples (under 1 MB).
PROGRAMS_KEPT = 64
_PROGRAMS: "OrderedDict[str, list[tuple]]" = OrderedDict()
# A program to lower: (graph, is_backward, donated inputs, and for a backward the forward it follows:
# it arrives with the strides that forward's program returns, ``arrival_strides``).
Program = tuple[fx.GraphModule, bool, "list[int] | None", "fx.GraphModule | None"]
# Programs being lowered in forked children (``start_lowering``), by fingerprint (a backward's
# without its arrival strides): the child and the fingerprints of its whole share, in its order.
_PENDING: dict[str, tuple[Child, list[str]]] = {}
# Graph constants up to this many elements are fingerprinted by value (Inductor folds small ones).
SMALL_CONSTANT = 16


@dataclass(frozen=True)
class InductorStep:
    """Predicted memory of one step under Inductor (bytes above the pre-step baseline)."""

    peak: int
    forward_peak: int
    backward_peak: int
    held_at_backward: int
    """Live when the backward starts: saved storages, held outputs, tangents."""
    other_peak: int = 0
    """The step's peak under the other assumption about the outputs (held if ``peak`` took
    them as released, released if held): the same programs, replayed once more."""
    kernels: int = 0
    """Kernels the two programs call, Inductor's own and extern ones (``mm``, convolutions)."""


def _storage(node) -> tuple[StorageWeakRef, int] | None:
    """A node's storage and its size in bytes."""
    key = storage_of(node)
    return None if key is None else (key, size_hint(node.meta["val"].untyped_storage().nbytes()))


def _input_storages(gm: fx.GraphModule) -> set[StorageWeakRef]:
    """The storages of ``gm``'s inputs (the caller's: a program allocates none of them)."""
    return {s[0] for s in map(_storage, gm.graph.find_nodes(op="placeholder")) if s is not None}


def replay(
    events: list[tuple],
    inputs: dict[str, tuple[object, int, bool]],
    start: int,
    scratch_by_name: dict[str, int],
    scratch_at: Callable[..., int | None] | None = None,
) -> tuple[int, int]:
    """Replay a program's memory events; returns (peak, live at the end).

    Args:
        events: ``inductor_program_events`` of the program.
        inputs: input name -> (block key, bytes, freeable). Names sharing a key
            share one block, freed (when freeable) once all of them are deleted.
        start: live bytes when the program starts (held inputs included).
        scratch_by_name: workspace bytes of fx nodes, added while their kernel runs.
        scratch_at: the workspace of an extern kernel's fx node at the input strides
            Inductor gives it, when they differ from the graph's, or of the call itself when
            Inductor made the node (``passes.scratch.ScratchAt``); None where neither applies.
    """
    refs: dict[object, int] = {}
    size: dict[object, int] = {}
    freeable: dict[object, bool] = {}
    block_of: dict[str, object] = {}
    held: dict[str, list[object]] = {}  # a tuple's name -> the blocks of the outputs it holds
    for name, (key, nbytes, can_free) in inputs.items():
        block_of[name] = key
        refs[key] = refs.get(key, 0) + 1
        size[key], freeable[key] = nbytes, can_free
    live = peak = start
    for event in events:
        kind = event[0]
        if kind == "alloc":
            _, name, nbytes = event
            key = ("buffer", name)
            block_of[name], refs[key], size[key], freeable[key] = key, 1, nbytes, True
            live += nbytes
        elif kind == "reuse":
            _, old, new = event
            if old in block_of:
                block_of[new] = block_of.pop(old)
        elif kind == "alias":
            _, old, new = event
            if old in block_of:
                block_of[new] = block_of[old]
                refs[block_of[new]] += 1
        elif kind == "hold":
            _, whole, part = event
            if part in block_of:
                held.setdefault(whole, []).append(block_of[part])
                refs[block_of[part]] += 1
        elif kind == "free":
            keys = [block_of.pop(event[1], None), *held.pop(event[1], ())]
            for key in keys:
                if key is not None:
                    refs[key] -= 1
                    if refs[key] == 0 and freeable[key]:
                        live -= size[key]
        elif kind == "kernel":
            scratch = {o: scratch_by_name.get(o, 0) for o in event[1]}
            extern = event[2] if len(event) > 2 else None
            if extern is not None and scratch_at is not None:
                at = scratch_at(*extern)
                if at is not None:
                    scratch[extern[0]] = at
            peak = max(peak, live + max(scratch.values(), default=0))
        peak = max(peak, live)
    return peak, live


def predict_step(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    scratch_by_name: dict[str, int] | None = None,
    *,
    outputs_released: bool = False,
    forward_peak: int | None = None,
    scratch_at: Callable[..., int | None] | None = None,
) -> InductorStep:
    """The peak of the step Inductor runs for the planned ``fw`` and ``bw``.

    ``forward_peak``: the forward's, when an earlier prediction lowered this same ``fw``
    (another version of the backward): its dry lowering is then skipped. ``scratch_at``:
    see ``replay``.
    """
    scratch = scratch_by_name or {}
    fw_inputs = list(fw.graph.find_nodes(op="placeholder"))
    caller = _input_storages(fw)
    fw_events = program_events(fw, is_backward=False)
    if forward_peak is None:
        held: dict[str, tuple[object, int, bool]] = {n.name: (("input", n.name), 0, False) for n in fw_inputs}
        forward_peak, _ = replay(fw_events, held, 0, scratch, scratch_at)

    outputs = outputs_of(fw)
    by_name = {n.name: n for n in outputs if isinstance(n, fx.Node)}
    user = _user_outputs(fw, num_fwd_outputs, caller)
    bw_events = program_events(
        bw,
        is_backward=True,
        donated=donated_inputs(fw, bw, num_fwd_outputs),
        strides=arrival_strides(fw_events, fw, bw),
    )
    # A scalar loss's seed gradient is alive through the backward (passes/simulate.py).
    seeds = seed_gradient_bytes(bw)
    # Autograd copies a gradient returned at other strides than its parameter's before it becomes
    # ``.grad`` (the layout contract), one after the other, all of them still held.
    copy = max(restrided_gradient_bytes(bw_events, bw), default=0)
    steps = {}
    for released in (outputs_released, not outputs_released):
        inputs, start = _backward_inputs(bw, by_name, caller, {} if released else user, seeds)
        peak, end = replay(bw_events, inputs, start, scratch, scratch_at)
        steps[released] = (max(peak, end + copy), start)
    backward_peak, start = steps[outputs_released]
    return InductorStep(
        max(forward_peak, backward_peak),
        forward_peak,
        backward_peak,
        start,
        max(forward_peak, steps[not outputs_released][0]),
        sum(1 for events in (fw_events, bw_events) for e in events if e[0] == "kernel"),
    )


def arrival_strides(fw_events: list[tuple], fw: fx.GraphModule, bw: fx.GraphModule) -> dict[int, tuple[int, ...]]:
    """``bw``'s placeholder positions whose saved value the compiled forward returns with other strides
    than the graph's (layout optimisation lays convolutions' activations out channels-last), and those
    strides: AOTAutograd compiles the backward for the strides the forward returned."""
    returned = next((e[1] for e in reversed(fw_events) if e[0] == "outputs"), None)
    if returned is None:
        return {}
    position: dict[str, int] = {}
    for i, node in enumerate(outputs_of(fw)):
        if isinstance(node, fx.Node):
            position.setdefault(node.name, i)
    strides: dict[int, tuple[int, ...]] = {}
    for j, ph in enumerate(bw.graph.find_nodes(op="placeholder")):
        at = position.get(ph.name)
        val = ph.meta.get("val")
        if is_tangent(ph) or at is None or at >= len(returned) or not isinstance(val, torch.Tensor):
            continue
        stride = returned[at]
        if (
            stride is not None
            and len(stride) == val.dim()
            and val.layout == torch.strided
            and strides_hint(val) != stride
        ):
            strides[j] = stride
    return strides


def restrided_gradient_bytes(bw_events: list[tuple], bw: fx.GraphModule) -> list[int]:
    """The bytes of each gradient the compiled backward returns at other strides than the graph traced
    (a convolution's weight gradient made from channels-last activations)."""
    returned = next((e[1] for e in reversed(bw_events) if e[0] == "outputs"), None)
    if returned is None:
        return []
    sizes = []
    for node, stride in zip(outputs_of(bw), returned):
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor) and stride is not None and strides_hint(val) != stride:
            sizes.append(size_hint(val.numel()) * val.element_size())
    return sizes


def _user_outputs(fw: fx.GraphModule, num_fwd_outputs: int, caller: set) -> dict[object, int]:
    """The storages of the forward's user outputs (none of the caller's inputs) and their bytes."""
    outputs = outputs_of(fw)
    return {s[0]: s[1] for s in map(_storage, outputs[:num_fwd_outputs]) if s is not None and s[0] not in caller}


def returned_bytes(fw: fx.GraphModule, num_fwd_outputs: int) -> tuple[int, int]:
    """The bytes ``fw`` returns, each storage once and its inputs' left out, and those of its saved
    values alone: they are all alive when it returns, so no program Inductor makes of it peaks lower."""
    caller = _input_storages(fw)
    outputs = outputs_of(fw)
    returned = {s[0]: s[1] for s in map(_storage, outputs) if s is not None and s[0] not in caller}
    saved = {s[0] for s in map(_storage, outputs[num_fwd_outputs:]) if s is not None and s[0] not in caller}
    return sum(returned.values()), sum(returned[s] for s in saved)


def donated_inputs(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> list[int]:
    """Positions of ``bw``'s placeholders AOTAutograd donates: the saved tensors no forward input,
    user output or gradient shares (Inductor may write into them in place)."""
    caller = _input_storages(fw)
    by_name = {n.name: n for n in outputs_of(fw) if isinstance(n, fx.Node)}
    user = _user_outputs(fw, num_fwd_outputs, caller)
    shared = caller | set(user) | {s[0] for s in map(_storage, outputs_of(bw)) if s is not None}
    return [
        i
        for i, ph in enumerate(bw.graph.find_nodes(op="placeholder"))
        if not is_tangent(ph)
        and ph.name in by_name
        and (s := _storage(by_name[ph.name])) is not None
        and s[0] not in shared
    ]


def _backward_inputs(bw: fx.GraphModule, by_name: dict, caller: set, pinned: dict, seeds: int):
    """The backward's inputs for ``replay`` (storage key, bytes, freed at its last use) and the bytes live at its start.

    ``pinned``: the user outputs' storages the caller holds through the backward (never freed by it).
    """
    held: dict[object, int] = dict(pinned)
    inputs: dict[str, tuple[object, int, bool]] = {}
    for ph in bw.graph.find_nodes(op="placeholder"):
        saved = not is_tangent(ph) and ph.name in by_name
        s = _storage(by_name[ph.name] if saved else ph)
        if s is None or GRAD_INPUT in ph.meta:  # a parameter's ``.grad``: the caller's memory
            inputs[ph.name] = (("input", ph.name), 0, False)
            continue
        key, nbytes = s
        if key in caller:
            inputs[ph.name] = (key, 0, False)
            continue
        held[key] = nbytes
        inputs[ph.name] = (key, nbytes, key not in pinned)
    return inputs, sum(held.values()) + seeds


# ------------------------------------------------------------ programs lowered once


def program_events(
    gm: fx.GraphModule,
    *,
    is_backward: bool,
    donated: list[int] | None = None,
    strides: dict[int, tuple[int, ...]] | None = None,
) -> list[tuple]:
    """``inductor_program_events`` of ``gm``, lowered once per process for the same program
    (``strides``: see ``inductor_program_events``).

    Graphs with symbolic sizes are lowered every time (their fingerprint would need the
    shape environment's hints).
    """
    key = _fingerprint(gm, is_backward, donated, strides)
    if key is None:
        return inductor_program_events(gm, is_backward=is_backward, donated=donated, strides=strides)
    events = _PROGRAMS.get(key)
    if events is not None:
        _PROGRAMS.move_to_end(key)
        return events
    # A child lowering it was handed it without the strides (it learns them from the forward's events).
    pending = key if key in _PENDING or not strides else _fingerprint(gm, is_backward, donated)
    if pending in _PENDING:
        _collect(pending)
        events = _PROGRAMS.get(key)
    if events is None:
        events = inductor_program_events(gm, is_backward=is_backward, donated=donated, strides=strides)
    _PROGRAMS[key] = events
    while len(_PROGRAMS) > PROGRAMS_KEPT:
        _PROGRAMS.popitem(last=False)
    return events


def start_lowering(programs: list[Program], here: bool = True, extra: int = 0) -> list[str]:
    """Lower ``programs`` (``Program``s, in the order this process will ask ``program_events`` for
    them) in forked children; ``program_events`` then takes their events. A backward is lowered with
    its arrival strides where the child knows its forward's events (this process knew them when it
    forked, or the child lowered that forward first); else without (taken when there are none).

    The programs not yet kept are cut into contiguous shares of about equal size (nodes), one
    child each, as many children as ``forked.workers`` allows beside this process and those already
    running. With ``here``, this process lowers the first share itself, going forward; without, it
    has other work to do meanwhile (a search) and every share goes to a child.
    ``extra``: children allowed beyond the workers' count (a lowering that may not be asked for,
    started where a core is often idle). Programs with symbolic sizes are left out, and all are
    when forking is off. Returns the fingerprints handed to children: pass them to ``stop_lowering``
    when done.
    """
    # A child that has answered holds no core: its events are kept now, and it is not counted (the
    # quickest plan's child, collected only after the candidates when it had not answered before them,
    # kept every candidate's programs in this process: one core idle for 6 s of benchmark Llama's 15;
    # end to end no change was measurable within this host's noise, docs/PLANNING_TIME.md).
    for answered in [k for k, (child, _) in _PENDING.items() if child.answered()]:
        if answered in _PENDING:
            _collect(answered)
    children = len({id(child) for child, _ in _PENDING.values()})
    free = workers() - 1 - children + (extra if workers() > 1 else 0)
    if free <= 0:
        return []
    todo: dict[str, Program] = {}
    for program in programs:
        key = _fingerprint(*program[:3])
        if key is not None and key not in _PROGRAMS and key not in _PENDING:
            todo.setdefault(key, program)
    if len(todo) < (2 if here else 1):
        return []
    keys = list(todo)
    forwards = {id(todo[k][0]): k for k in keys if not todo[k][1]}  # for a backward's forward in a share
    shares = _shares([len(todo[k][0].graph.nodes) for k in keys], min(free + (1 if here else 0), len(keys)))
    handed: list[str] = []
    for group in shares[1:] if here else shares:
        group_keys = [keys[i] for i in group]
        group_programs = [todo[k] for k in group_keys]
        nodes = sum(len(program[0].graph.nodes) for program in group_programs)
        what = f"{len(group_programs)} program{'s' * (len(group_programs) > 1)} ({nodes} nodes)"

        def lower(group_keys=group_keys, group_programs=group_programs) -> list[tuple[str | None, list[tuple]]]:
            return [_lowered_in_child(p, k, forwards) for p, k in zip(group_programs, group_keys)]

        try:
            child = fork_call(lower, what)
        except OSError as e:  # no process to spare (EAGAIN, ENOMEM): what was not handed out is lowered here
            log.info("fxremat: could not fork a child to lower %s (%s); lowering it here", what, e)
            break
        for k in group_keys:
            _PENDING[k] = (child, group_keys)
        handed += group_keys
    return handed


def _lowered_in_child(program: Program, key: str, forwards: dict[int, str]) -> tuple[str | None, list[tuple]]:
    """In a forked child: ``program``'s fingerprint (``key``, or with its arrival strides) and its events.
    ``forwards``: the fingerprints of the forwards handed out with it, by graph."""
    gm, is_backward, donated, forward = program
    strides = None
    if forward is not None:
        fw_key = forwards.get(id(forward)) or _fingerprint(forward, False, None)
        fw_events = _PROGRAMS.get(fw_key or "")
        if fw_events is not None:
            strides = arrival_strides(fw_events, forward, gm)
    events = inductor_program_events(gm, is_backward=is_backward, donated=donated, strides=strides)
    if not is_backward:  # for a backward after it in this child's share
        _PROGRAMS[key] = events
    return (_fingerprint(gm, is_backward, donated, strides) if strides else key), events


def _shares(sizes: list[int], parts: int) -> list[list[int]]:
    """``range(len(sizes))`` cut into ``parts`` contiguous, non-empty groups of about equal total size."""
    total, groups, start = sum(sizes), [], 0
    for part in range(parts):
        left = parts - part - 1  # groups still to come after this one, one item each at least
        end, taken = start + 1, sizes[start]
        target = total * (part + 1) / parts
        done = sum(sizes[:start]) + taken
        while end < len(sizes) - left and abs(done + sizes[end] - target) < abs(done - target):
            done += sizes[end]
            end += 1
        if part == parts - 1:
            end = len(sizes)
        groups.append(list(range(start, end)))
        start = end
    return groups


def _collect(key: str) -> None:
    """Keep the events of the share of the child lowering ``key`` (under their fingerprints with
    their arrival strides); none when it failed."""
    child, group = _PENDING[key]
    for k in group:
        _PENDING.pop(k, None)
    ok, answer = child.result()
    if not ok:
        log.info("fxremat: the forked dry lowering of %s failed (%s); lowering it here", child.what, answer)
        return
    for k, events in cast(list, answer):
        if k is not None:
            _PROGRAMS[k] = events


def lowerings_answered(keys: list[str]) -> bool:
    """Every child lowering one of ``keys`` has answered (taking their events will not wait)."""
    return all(key not in _PENDING or _PENDING[key][0].answered() for key in keys)


def stop_lowering(keys: list[str]) -> None:
    """End the children lowering ``keys`` whose events were not taken (the judgement that wanted them is over)."""
    for key in keys:
        if key in _PENDING:
            child, group = _PENDING[key]
            for k in group:
                _PENDING.pop(k, None)
            child.cancel()


def forget_programs() -> None:
    """Drop the programs ``program_events`` kept (tests that count or replace lowerings)."""
    _PROGRAMS.clear()
    stop_lowering(list(_PENDING))


def _fingerprint(
    gm: fx.GraphModule, is_backward: bool, donated: list[int] | None, strides: dict | None = None
) -> str | None:
    """What Inductor's program for ``gm`` depends on, hashed; None when a size is symbolic."""
    digest = hashlib.sha256()
    # The partitioner made ``gm``: the lowering does not call it (each compile has its own).
    settings = compiler_config_digest(ignoring=("custom_partitioner_fn",))
    arrival = sorted((strides or {}).items())
    digest.update(f"{is_backward} {sorted(donated or [])} {arrival} {settings}\n".encode())
    digest.update(gm.graph.python_code("self").src.encode())
    # Subgraphs of higher-order ops (flex attention's score functions, wrapped regions) are attributes.
    for path, module in gm.named_modules():
        if module is not gm and isinstance(module, fx.GraphModule):
            digest.update(f"{path}\n{module.graph.python_code('self').src}".encode())
    first_of: dict[object, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        val = node.meta.get("val")
        if node.op == "get_attr":
            val = getattr(gm, str(node.target), None)
        for t in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return None
            if not isinstance(t, torch.Tensor):
                digest.update(repr(t).encode() if node.op == "placeholder" else b"-")
                continue
            strided = t.layout == torch.strided
            sizes = (*t.shape, *(t.stride() if strided else ()), t.storage_offset() if strided else 0)
            if not all(isinstance(x, int) for x in sizes):
                return None
            shared = -1
            if node.op == "placeholder" and (key := storage_of(node)) is not None:
                shared = first_of.setdefault(key, i)
            digest.update(f"{node.name} {sizes} {t.dtype} {t.device} {shared}\n".encode())
            if node.op == "get_attr" and t.numel() <= SMALL_CONSTANT and not isinstance(t, FakeTensor):
                digest.update(repr(t.tolist()).encode())  # a small constant Inductor may fold
    return digest.hexdigest()
