"""Solvers on synthetic problems: exact against brute force, heuristics against the ILP.

The problems are plain data: a forward spec, mirrored into a backward with
one gradient node per forward node (reverse order), tangents for the
outputs, weight gradients returned as outputs, and views sharing storage.
"""

from __future__ import annotations

import ast
import math
import pathlib
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fxremat.solvers import SOLVERS, get_solver, schedule, solve
from fxremat.solvers.ilp import solve_ilp
from fxremat.solvers.mincut import solve_mincut
from fxremat.solvers.registry import WITHIN_GREEDY_SHARE, WITHIN_RESOLUTION, WITHIN_ROUNDS, solve_within
from fxremat.solvers.policies import keep_layer_inputs, solve_per_layer, solve_sqrt_n
from fxremat.solvers.rules import rules
from fxremat.solvers.types import BACKWARD, FORWARD, Decision, RematProblem, SolveOptions

SOLVERS_DIR = pathlib.Path(__file__).resolve().parents[1] / "fxremat" / "solvers"
# The default work limits; the safety net well above what these small problems need.
OPTIONS = SolveOptions()
# Hypothesis: enough examples to meet views, tags and infeasible budgets, few
# enough that the whole file stays well under 30 s.
EXAMPLES = 30


# --------------------------------------------------------------------------
# Synthetic problems
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Fw:
    """One forward node of a synthetic problem."""

    inputs: tuple[int, ...] = ()
    nbytes: int = 1
    seconds: float = 1.0
    saves: tuple[int, ...] = ()  # forward ids its gradient node reads
    view_of: int | None = None  # input whose storage it aliases (then it allocates nothing)
    layer: int = -1
    param_bytes: int = 0  # > 0: a weight gradient of this size is returned


def build(fw: list[Fw], outputs, never_recompute=(), must_save=(), must_recompute=()) -> RematProblem:
    """Mirror a forward into a joint graph: one gradient node per forward node, in reverse order."""
    n_fw = len(fw)
    names = [f"f{v}" for v in range(n_fw)]
    phase = [FORWARD] * n_fw
    inputs = [spec.inputs for spec in fw]
    storage: list[int] = []
    for v, spec in enumerate(fw):
        storage.append(v if spec.view_of is None else storage[spec.view_of])
    nbytes = [0 if spec.view_of is not None else spec.nbytes for spec in fw]
    seconds = [spec.seconds for spec in fw]
    consumers: dict[int, list[int]] = {v: [] for v in range(n_fw)}
    for v, spec in enumerate(fw):
        for u in spec.inputs:
            consumers[u].append(v)

    def add(name, ins, size, sec, owner=None):
        names.append(name)
        phase.append(BACKWARD)
        inputs.append(tuple(ins))
        nbytes.append(0 if owner is not None else size)
        storage.append(len(names) - 1 if owner is None else owner)
        seconds.append(sec)
        return len(names) - 1

    tangent = {o: add(f"tangent_f{o}", (), nbytes[storage[o]], 0.0) for o in outputs}
    grad: dict[int, int] = {}
    returned = []
    for v in reversed(range(n_fw)):
        spec = fw[v]
        sources = [grad[w] for w in consumers[v] if w in grad] + ([tangent[v]] if v in tangent else [])
        if not sources:
            continue
        ins = sources + list(spec.saves)
        if spec.view_of is not None and len(sources) == 1:
            grad[v] = add(f"grad_f{v}", ins, 0, 0.0, owner=storage[sources[0]])
        else:
            grad[v] = add(f"grad_f{v}", ins, nbytes[storage[v]] or 1, 2 * spec.seconds)
        if spec.param_bytes:
            returned.append(add(f"wgrad_f{v}", ins, spec.param_bytes, spec.seconds))
        if not spec.inputs:
            returned.append(grad[v])
    layers = [spec.layer for spec in fw] + [-1] * (len(names) - n_fw)
    return RematProblem(
        names=tuple(names),
        phase=tuple(phase),
        inputs=tuple(inputs),
        nbytes=tuple(nbytes),
        storage=tuple(storage),
        seconds=tuple(seconds),
        flops=tuple(int(s * 1e9) for s in seconds),
        fw_outputs=tuple(sorted(outputs)),
        bw_outputs=tuple(sorted(returned)),
        tangents=tuple(sorted(tangent.values())),
        must_save=tuple(sorted({storage[v] for v in must_save})),  # a view is saved through its storage
        never_recompute=tuple(sorted(never_recompute)),
        must_recompute=tuple(sorted(must_recompute)),
        layer=tuple(layers) if any(spec.layer >= 0 for spec in fw) else (),
    )


def chain(n: int, nbytes: int = 4, seconds: float = 1.0, layers: int = 0) -> RematProblem:
    """x0 -> x1 -> ... -> x(n-1) (the output); each gradient reads its node's input."""
    fw = [
        Fw((v - 1,) if v else (), nbytes, seconds, (v - 1,) if v else (), layer=(v * layers // n if layers else -1))
        for v in range(n)
    ]
    return build(fw, [n - 1])


def diamond() -> RematProblem:
    """x -> (l, r) -> j -> y: two branches the backward reads, joined."""
    fw = [
        Fw((), 8, 1.0),
        Fw((0,), 8, 2.0, (0,)),
        Fw((0,), 8, 3.0, (0,)),
        Fw((1, 2), 8, 1.0, (1, 2)),
        Fw((3,), 1, 1.0, (3,)),
    ]
    return build(fw, [4])


def transformer(
    layers: int = 12, pointwise: int = 6, seq: int = 512, hidden: int = 768, heads: int = 12, batch: int = 4
) -> RematProblem:
    """A GPT-like stack: per layer layernorm, qkv, attention, MLP; each pointwise op a chain of nodes.

    Bytes are fp32 activations; seconds a roofline on a 100 TFLOP/s, 2 TB/s
    device plus a 5 us launch. ``pointwise`` sets the chain length, and so
    the graph's size (6: ~35 forward nodes per layer, 30: ~120).
    """
    act = seq * batch * hidden * 4
    att = seq * seq * batch * heads * 4
    fw: list[Fw] = []

    def node(inputs, nbytes, flops, saves=(), view_of=None, layer=-1, param_bytes=0):
        fw.append(
            Fw(
                tuple(inputs),
                nbytes,
                max(flops / 100e12, nbytes / 2e12) + 5e-6,
                tuple(saves),
                view_of,
                layer,
                param_bytes,
            )
        )
        return len(fw) - 1

    def chain_of(x, nbytes, layer, length):
        for i in range(length):
            x = node([x], nbytes, nbytes, saves=[x] if i % 2 == 0 else [], layer=layer)
        return x

    def mm(x, out_bytes, k, layer):
        return node(
            [x], out_bytes, 2 * (out_bytes // 4) * k, saves=[x], layer=layer, param_bytes=k * out_bytes // (seq * batch)
        )

    x = node([], act, act)  # embedding
    for layer in range(layers):
        h = chain_of(x, act, layer, pointwise)
        q, k, v = (mm(h, act, hidden, layer) for _ in range(3))
        qv, kv, vv = (node([t], 0, 0, view_of=t, layer=layer) for t in (q, k, v))
        s = node([qv, kv], att, 2 * seq * seq * hidden * batch, saves=[qv, kv], layer=layer)
        p = chain_of(s, att, layer, max(1, pointwise // 2))
        a = node([p, vv], act, 2 * seq * seq * hidden * batch, saves=[p, vv], layer=layer)
        o = mm(node([a], 0, 0, view_of=a, layer=layer), act, hidden, layer)
        x1 = node([x, o], act, act, layer=layer)
        u = mm(chain_of(x1, act, layer, pointwise), 4 * act, hidden, layer)
        d = mm(chain_of(u, 4 * act, layer, pointwise), act, 4 * hidden, layer)
        x = node([x1, d], act, act, layer=layer)
    loss = node([chain_of(x, act, -1, 2)], 4, act, saves=[len(fw) - 1])
    return build(fw, [loss])


@st.composite
def problems(draw, max_forward: int = 10) -> RematProblem:
    """Random DAGs of up to ``max_forward`` forward nodes, with views, layers and tags.

    Mostly chain-like (each node usually reads its predecessor, sometimes an
    earlier node too) with small and large values, so that recomputing from
    small checkpoints can pay off in memory (in about a quarter of the
    problems some plan beats saving everything); the last node is a small
    loss-like output. At most 10 forward nodes keep brute force at 1024 plans.
    """
    n = draw(st.integers(1, max_forward))
    layered = draw(st.booleans())
    n_layers = draw(st.integers(1, 3))
    fw = []
    for v in range(n):
        inputs = ()
        if v:
            first = draw(st.one_of(st.just(v - 1), st.integers(0, v - 1)))
            inputs = tuple(sorted({first} | draw(st.sets(st.integers(0, v - 1), max_size=1))))
        is_view = bool(inputs) and draw(st.integers(0, 5)) == 0
        if is_view:
            # A view reads its base and nothing else, as every aliasing op of AOTAutograd's
            # functional joint graph does (a two-input "view" made save_all recompute its
            # second input: a case no real graph has, drawn about once in 20 runs).
            inputs = inputs[:1]
        fw.append(
            Fw(
                inputs=inputs,
                nbytes=1 if v == n - 1 else draw(st.sampled_from([1, 2, 16])),
                seconds=draw(st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0])),
                saves=tuple(sorted(draw(st.sets(st.sampled_from(inputs + (v,)), min_size=1, max_size=2)))),
                view_of=inputs[0] if is_view else None,
                layer=v * n_layers // n if layered else -1,
                param_bytes=draw(st.sampled_from([0, 0, 2])),
            )
        )
    outputs = sorted({n - 1} | draw(st.sets(st.integers(0, n - 1), max_size=1)))
    tag = st.sets(st.integers(0, n - 1), max_size=2)
    rare = st.one_of(st.just(set()), st.just(set()), tag)
    p = build(
        fw,
        outputs,
        never_recompute=draw(rare),
        must_save=draw(rare),
        must_recompute=draw(st.one_of(st.just(set()), st.just(set()), st.just(set()), tag)),
    )
    # Inductor-style fusion: some values (forward or backward) allocate nothing unless kept or returned.
    owners = [v for v in range(p.size) if p.storage[v] == v and p.nbytes[v] and v not in p.tangents]
    fused = draw(st.one_of(st.just(set()), st.sets(st.sampled_from(owners), max_size=len(owners)))) if owners else set()
    # Inductor-style in-place reuse: a value may write into an earlier same-size buffer that dies there.
    pairs = [(v, u) for v in owners for u in owners if u < v and p.nbytes[u] == p.nbytes[v]]
    inplace = draw(st.one_of(st.just(set()), st.sets(st.sampled_from(pairs), max_size=4))) if pairs else set()
    return replace(p, fused=tuple(sorted(fused)), outputs_released=draw(st.booleans()), inplace=tuple(sorted(inplace)))


def valid_rules(p: RematProblem) -> bool:
    try:
        rules(p)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Truth:
    """Every plan of a small problem, by brute force."""

    plans: tuple[tuple[tuple[int, ...], int, float], ...]  # (kept, peak, seconds) per valid closed plan

    def fastest(self, budget):
        fits = [s for _, peak, s in self.plans if budget is None or peak <= budget]
        return min(fits) if fits else None

    @property
    def least_peak(self) -> int:
        return min(peak for _, peak, _ in self.plans)


def brute_force(p: RematProblem) -> Truth:
    """Enumerate every subset of forward nodes, close and simulate it; drop plans keeping must_recompute."""
    forward = [v for v in range(p.size) if p.phase[v] == FORWARD]
    plans = {}
    for mask in range(1 << len(forward)):
        kept, _, peak, seconds = schedule.evaluate(p, [v for i, v in enumerate(forward) if mask >> i & 1])
        if not set(kept) & set(p.must_recompute):
            plans[kept] = (kept, peak, seconds)
    return Truth(tuple(plans[k] for k in sorted(plans)))


def budgets(truth: Truth):
    """Budgets at reachable peaks (more often below the fastest plan's), one below the least, and None."""
    peaks = sorted({peak for _, peak, _ in truth.plans})
    fastest = min(truth.plans, key=lambda plan: (plan[2], plan[1]))[1]
    tight = [peak for peak in peaks if peak < fastest] or peaks
    return st.one_of(
        st.none(), st.sampled_from(peaks), st.sampled_from(tight), st.sampled_from(tight), st.just(peaks[0] - 1)
    )


def assert_valid(p: RematProblem, d: Decision) -> None:
    """The decision is a closed plan that honours every tag, and its numbers are the simulation's."""
    kept, recomputed = set(d.kept), set(d.recomputed)
    assert not kept & recomputed
    available = kept | recomputed
    assert set(schedule.bw_reads(p)) <= available
    for v in recomputed:
        assert all(u in available for u in p.inputs[v] if p.phase[u] == FORWARD), f"{v} recomputed without its inputs"
    assert not recomputed & set(p.never_recompute)
    assert not recomputed & set(p.must_save)
    assert not kept & set(p.must_recompute)
    assert (d.kept, d.recomputed, d.peak_bytes) == schedule.evaluate(p, d.kept)[:3]
    assert d.recompute_seconds == pytest.approx(schedule.evaluate(p, d.kept)[3])
    assert list(d.kept) == sorted(d.kept) and list(d.recomputed) == sorted(d.recomputed)


def assert_exact(d: Decision, truth: Truth, budget) -> bool:
    """``d`` is the fastest plan that fits (True), or, when none fits, reports the least peak (False)."""
    best = truth.fastest(budget)
    if best is None:
        assert not d.feasible
        assert d.peak_bytes == truth.least_peak
        return False
    assert d.feasible and (budget is None or d.peak_bytes <= budget)
    assert d.recompute_seconds == pytest.approx(best, abs=1e-9)
    return True


def same(a: Decision, b: Decision) -> bool:
    return replace(a, solve_seconds=0.0) == replace(b, solve_seconds=0.0)


# --------------------------------------------------------------------------
# Layering and registry
# --------------------------------------------------------------------------


def test_solvers_never_import_torch():
    for path in sorted(SOLVERS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(name == "torch" or name.startswith("torch.") for name in names), f"{path.name} imports torch"


def test_registry_lists_every_solver():
    assert list(SOLVERS) == ["auto", "ilp", "mincut", "save_all", "per_layer", "sqrt_n", "save_inputs"]
    assert get_solver("mincut") is solve_mincut


@pytest.mark.parametrize("name", ["greedy", "", "ILP"])
def test_unknown_solver_names_the_valid_ones(name):
    with pytest.raises(ValueError, match="auto, ilp, mincut, save_all, per_layer, sqrt_n, save_inputs"):
        get_solver(name)
    with pytest.raises(ValueError, match="unknown solver"):
        solve(chain(3), None, name)


# --------------------------------------------------------------------------
# Reference policies
# --------------------------------------------------------------------------


def test_policies_on_a_chain():
    p = chain(16)
    assert solve(p, None, "save_all").recomputed == ()
    # save_inputs keeps only the output (held anyway); everything else is recomputed.
    d = solve(p, None, "save_inputs")
    assert d.kept == () and d.recomputed == tuple(range(15))
    # sqrt(16) = 4 segments: the values crossing the 3 boundaries (positions 4, 8, 12).
    assert solve(p, None, "sqrt_n").kept == (3, 7, 11)


def test_per_layer_keeps_layer_inputs():
    p = chain(12, layers=3)  # layers of 4 nodes: 0-3, 4-7, 8-11
    assert keep_layer_inputs(p) == (3, 7, 11)
    d = solve_per_layer(p, None)
    assert d.kept == (3, 7) and d.note == ""
    assert set(d.recomputed) == set(range(12)) - {3, 7, 11}


def test_per_layer_without_layers_falls_back_to_sqrt_n():
    p = chain(16)
    d = solve_per_layer(p, None)
    assert d.kept == solve_sqrt_n(p, None).kept
    assert "sqrt_n" in d.note and d.solver == "per_layer"


# --------------------------------------------------------------------------
# Exact and heuristic solvers against brute force
# --------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_ilp_equals_brute_force(p, data):
    assume(valid_rules(p))
    truth = brute_force(p)
    budget = data.draw(budgets(truth))
    d = solve_ilp(p, budget, OPTIONS)
    assert_valid(p, d)
    if assert_exact(d, truth, budget):
        assert d.gap == 0.0


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_milp_search_alone_equals_brute_force(p, data):
    # A warm start that rarely fits (keep only outputs), so the MILP rounds do the work.
    assume(valid_rules(p))
    truth = brute_force(p)
    budget = data.draw(budgets(truth))
    d = solve_ilp(p, budget, OPTIONS, warm=solve(p, budget, "save_inputs"))
    assert_valid(p, d)
    best = truth.fastest(budget)
    assert d.feasible == (best is not None)
    if best is not None:
        assert d.recompute_seconds == pytest.approx(best, abs=1e-9) and d.gap == 0.0


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_mincut_is_never_better_than_ilp_and_fits_when_ilp_does(p, data):
    assume(valid_rules(p))
    truth = brute_force(p)
    budget = data.draw(budgets(truth))
    cut = solve_mincut(p, budget, OPTIONS)
    exact = solve_ilp(p, budget, OPTIONS)
    assert_valid(p, cut)
    assert cut.feasible == exact.feasible
    if exact.feasible:
        assert cut.recompute_seconds >= exact.recompute_seconds - 1e-9
    else:
        assert cut.peak_bytes == exact.peak_bytes == truth.least_peak


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_every_solver_returns_a_closed_plan_that_honours_tags(p, data):
    assume(valid_rules(p))
    budget = data.draw(st.one_of(st.none(), st.integers(0, 60)))
    for name in SOLVERS:
        d = solve(p, budget, name, OPTIONS)
        assert_valid(p, d)
        assert d.feasible == (budget is None or d.peak_bytes <= budget)
        assert d.solver.split(":")[0] == name


@settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_solvers_are_deterministic(p, data):
    assume(valid_rules(p))
    budget = data.draw(st.one_of(st.none(), st.integers(0, 60)))
    for name in ("auto", "ilp", "mincut"):
        assert same(solve(p, budget, name, OPTIONS), solve(p, budget, name, OPTIONS))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_solve_within_finds_the_least_peak_within_the_slack(p, data):
    """Exact with the ILP once its bisection has narrowed the peak to WITHIN_RESOLUTION."""
    assume(valid_rules(p))
    truth = brute_force(p)
    slack = data.draw(st.sampled_from(sorted({s for _, _, s in truth.plans} | {0.0})))
    fastest = solve(p, None, "ilp", OPTIONS)
    d = solve_within(p, slack, "ilp", OPTIONS, fastest)
    assert_valid(p, d)
    assert d.peak_bytes <= fastest.peak_bytes
    if slack <= fastest.recompute_seconds:
        assert d == fastest
        return
    assert d.recompute_seconds <= slack + 1e-12
    best = min(peak for _, peak, s in truth.plans if s <= slack + 1e-12)
    least = solve(p, 1, "ilp", OPTIONS).peak_bytes
    resolution = max(1, int(WITHIN_RESOLUTION * fastest.peak_bytes))
    if fastest.peak_bytes - least <= resolution << WITHIN_ROUNDS:  # the bisection converged
        assert d.peak_bytes <= best + resolution - 1
    for name in ("auto", "mincut"):  # heuristics: within the slack, never above the fastest plan
        h = solve_within(p, slack, name, OPTIONS)
        assert_valid(p, h)
        assert h.recompute_seconds <= max(slack, solve(p, None, name, OPTIONS).recompute_seconds) + 1e-12
        assert h.peak_bytes <= solve(p, None, name, OPTIONS).peak_bytes
        assert same(h, solve_within(p, slack, name, OPTIONS))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_solve_within_searches_below_the_least_cut_only_when_that_cut_fits_the_slack(p, data):
    """The greedy search below min-cut's sweep (up to a share of GREEDY_MAX_WORK: 13 of the 21 s a
    32-layer Llama-3-8B shape's no-budget search took) only moves the bisection's lower end unless the
    least cut is within the slack, where a lower peak could be the answer."""
    from unittest import mock

    from fxremat.solvers import mincut

    assume(valid_rules(p))
    fastest = solve(p, None, "mincut", OPTIONS)
    slack = data.draw(st.floats(0.0, 2.0 * sum(p.seconds) + 1e-9, allow_nan=False))
    assume(slack > fastest.recompute_seconds)
    least_cut = solve_mincut(p, 1, OPTIONS, search_below=False)
    searched: list[int | None] = []
    shares: list[float] = []
    real = mincut.least_peak_search

    def counted(problem, budget, *args, **kwargs):
        searched.append(budget)
        shares.append(kwargs.get("share", 1.0))
        return real(problem, budget, *args, **kwargs)

    with mock.patch.object(mincut, "least_peak_search", counted):
        d = solve_within(p, slack, "mincut", OPTIONS, fastest)
    assert_valid(p, d)
    # The lower end's search (budget 1) gets a share of the work (WITHIN_GREEDY_SHARE): a bracket, not the
    # least plan. The bisection's own solves keep the whole work where no cut fits their target.
    assert all(share == WITHIN_GREEDY_SHARE < 1 for budget, share in zip(searched, shares) if budget == 1)
    assert d.recompute_seconds <= slack + 1e-12 and d.peak_bytes <= fastest.peak_bytes
    below_the_sweep = 1 in searched
    if least_cut.feasible:  # budget 1 met by a cut: there is nothing below the sweep to search
        assert not below_the_sweep
    else:
        assert below_the_sweep == (least_cut.recompute_seconds <= slack)
    if least_cut.recompute_seconds <= slack:
        assert d.peak_bytes <= least_cut.peak_bytes


@settings(max_examples=EXAMPLES, deadline=None)
@given(problems())
def test_no_budget_means_no_recompute(p):
    """Without a budget nothing that costs time is recomputed.

    One value per storage is saved, so aliases of a kept storage are recomputed
    as views; views cost no time here, as they cost next to none in real graphs.
    """
    views_free = tuple(0.0 if p.storage[v] != v else t for v, t in enumerate(p.seconds))
    # Nothing marks a view as impossible to recompute in a real graph (random and effectful ops
    # allocate); a view drawn so would have to be saved in place of its owner, which the backward
    # then recomputes (drawn about once in 20 runs).
    owners_only = tuple(v for v in p.never_recompute if p.storage[v] == v)
    p = replace(p, must_recompute=(), seconds=views_free, never_recompute=owners_only)
    assume(valid_rules(p))
    for name in ("auto", "ilp", "mincut", "save_all"):
        d = solve(p, None, name, OPTIONS)
        assert d.feasible and d.recompute_seconds == 0.0, d


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(problems())
def test_must_recompute_is_rejected_exactly_when_no_plan_exists(p):
    has_plan = bool(brute_force(p).plans)
    assert valid_rules(p) == has_plan
    if not has_plan:
        with pytest.raises(ValueError, match="must_recompute") as error:
            solve(p, None, "mincut")
        assert any(p.names[v] in str(error.value) for v in p.must_recompute)


# --------------------------------------------------------------------------
# Hand-built cases
# --------------------------------------------------------------------------


def test_never_recompute_values_are_kept_even_when_saving_inputs():
    p = replace(chain(6), never_recompute=(2,))
    for name in SOLVERS:
        d = solve(p, 1, name, OPTIONS)
        assert 2 in d.kept and 2 not in d.recomputed


def test_must_recompute_conflict_names_the_node():
    p = replace(chain(4), must_recompute=(2,), never_recompute=(2,))
    with pytest.raises(ValueError, match=r"f2 \(id 2\).*never_recompute"):
        solve(p, None, "ilp")


def test_diamond_budgets():
    p = diamond()
    truth = brute_force(p)
    for budget in sorted({peak for _, peak, _ in truth.plans}):
        assert solve_ilp(p, budget, OPTIONS).recompute_seconds == pytest.approx(truth.fastest(budget))
        assert solve(p, budget, "auto", OPTIONS).recompute_seconds == pytest.approx(truth.fastest(budget))


def test_every_budget_of_a_chain_with_small_checkpoints():
    # Small values every third node: keeping them and recomputing the large
    # ones between them is what fits tight budgets.
    fw = [Fw((v - 1,) if v else (), 1 if v % 3 == 0 else 16, 1.0 + v % 2, (v - 1,) if v else (v,)) for v in range(9)]
    p = build(fw, [8])
    truth = brute_force(p)
    assert truth.least_peak < truth.plans[0][1]
    for budget in sorted({peak for _, peak, _ in truth.plans}) + [truth.least_peak - 1]:
        best = truth.fastest(budget)
        exact, cut = solve_ilp(p, budget, OPTIONS), solve_mincut(p, budget, OPTIONS)
        assert exact.feasible == cut.feasible == (best is not None)
        if best is not None:
            assert exact.recompute_seconds == pytest.approx(best) and exact.gap == 0.0
            assert cut.recompute_seconds >= best - 1e-9


def test_infeasible_budget_returns_the_least_peak():
    p = diamond()
    truth = brute_force(p)
    for name in ("auto", "ilp", "mincut"):
        d = solve(p, truth.least_peak - 1, name, OPTIONS)
        assert not d.feasible and d.peak_bytes == truth.least_peak


def test_progress_is_reported():
    calls = []
    solve_mincut(transformer(layers=3, pointwise=2), 1, SolveOptions(progress=lambda *a: calls.append(a)))
    assert calls and all(done <= total for done, total, _ in calls)


def test_transformer_stack_fits_shrinking_budgets():
    p = transformer(layers=2, pointwise=2)
    full = solve(p, None, "save_all").peak_bytes
    previous = 0.0
    for fraction in (0.8, 0.5):
        budget = int(full * fraction)
        d = solve(p, budget, "auto", OPTIONS)
        assert d.feasible and d.peak_bytes <= budget
        assert d.solver in ("auto:ilp", "auto:mincut")
        assert d.gap is None or 0.0 <= d.gap < 1.0
        assert d.recompute_seconds >= previous - 1e-12
        previous = d.recompute_seconds
        cut = solve_mincut(p, budget, OPTIONS)
        assert cut.feasible and cut.recompute_seconds >= d.recompute_seconds - 1e-12
        assert math.isfinite(d.solve_seconds)


def test_mincut_reuses_its_cuts_across_solves_of_one_problem():
    """The budget search solves one problem at several targets: cuts depend on the problem and
    lam alone, so they are made once per problem, and a plan is what a fresh solve gives."""
    from fxremat.solvers import mincut

    p = transformer(4)
    lo = solve(p, 1, "mincut").peak_bytes
    hi = solve(p, None, "save_all").peak_bytes
    targets = [lo + (hi - lo) * k // 4 for k in (1, 2, 3)]
    first = [solve(p, t, "mincut") for t in targets]
    cutter = mincut._CUTTERS.get(p)
    made = cutter.cuts
    again = [solve(p, t, "mincut") for t in reversed(targets)][::-1]
    assert mincut._CUTTERS.get(p) is cutter and cutter.cuts == made, "solved again: cut again"
    mincut._CUTTERS.clear()
    fresh = [solve(p, t, "mincut") for t in targets]
    assert [d.kept for d in first] == [d.kept for d in again] == [d.kept for d in fresh]


def test_auto_leaves_the_ilp_out_where_only_the_greedy_least_peak_search_fits(monkeypatch):
    """Near the least peak no min-cut plan fits and each MILP round's plan peaks over until the node
    limit: ``auto`` keeps the greedy search's plan without a solve (registry.py, the measurements)."""
    from fxremat.solvers import mincut, registry

    p = transformer(layers=2)
    least = solve_mincut(p, 1)
    # What solve_mincut writes when the greedy search ran (more free values than the exhaustive search tries).
    monkeypatch.setattr(mincut, "EXHAUSTIVE_MAX_CHOICES", 0)
    below = solve_mincut(p, least.peak_bytes - 1)
    assert not below.feasible and mincut.searched_greedily(below), below.note
    assert not mincut.searched_greedily(solve_mincut(p, None))

    fits = replace(below, peak_bytes=least.peak_bytes, feasible=True)

    def no_ilp(*args, **kwargs):
        raise AssertionError("the ILP ran")

    monkeypatch.setattr(registry, "solve_mincut", lambda *args, **kwargs: fits)
    monkeypatch.setattr(registry, "solve_ilp", no_ilp)
    d = registry.solve_auto(p, least.peak_bytes)
    assert d.kept == fits.kept and d.solver == "auto:mincut"
    assert "ILP skipped: no min-cut plan fits" in d.note, d.note
    # Where the greedy plan does not fit either, the ILP still looks (a budget below the least peak).
    monkeypatch.setattr(registry, "solve_mincut", lambda *args, **kwargs: below)
    with pytest.raises(AssertionError, match="the ILP ran"):
        registry.solve_auto(p, least.peak_bytes - 1)
