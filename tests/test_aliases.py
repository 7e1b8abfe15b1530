"""One saved value per storage: the class of the T5 wrong gradient (issue 19).

AOTAutograd donates to the backward every saved tensor whose storage no input
or output shares, and Inductor may write a kernel's output into a donated
buffer at what it sees as the buffer's last use. It does not look for
aliasing between saved tensors: with a value and a view of it both saved, a
later read of the view sees overwritten memory. HF T5's feed-forward block
(``relu_2`` and ``view_81 = view(relu_2)`` both saved) got a gradient with
relative error 1.0 this way. The planner now keeps one value per storage
(``schedule.close``) and checks the programs it hands on
(``passes/invariants.py``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fxremat
from checks import compare  # noqa: E402
from fxremat.passes.invariants import PlanInvariantError, check_saved_aliases
from fxremat.solvers import SOLVERS, schedule, solve
from fxremat.solvers.types import BACKWARD, FORWARD, RematProblem, SolveOptions

from test_solvers import problems, valid_rules  # noqa: E402  (tests/ is on sys.path under pytest)

F, B = FORWARD, BACKWARD
# Inductor compiles per example; `make fuzz`-style runs can ask for more.
INDUCTOR_EXAMPLES = int(os.environ.get("FXREMAT_ALIAS_EXAMPLES", "3"))


# --------------------------------------------------------------------------
# The solver layer: close keeps one value per storage
# --------------------------------------------------------------------------


def _value_and_view() -> RematProblem:
    # h (8 B) and v = view(h); the backward reads both (a weight gradient reads v,
    # a pointwise gradient reads h), as T5's relu_2 / view_81.
    return RematProblem(
        names=("h", "v", "out", "t", "gh", "gv"),
        phase=(F, F, F, B, B, B),
        inputs=((), (0,), (1,), (), (3, 0), (4, 1)),
        nbytes=(8, 0, 4, 4, 8, 8),
        storage=(0, 0, 2, 3, 4, 5),
        seconds=(1.0, 0.0, 1.0, 0.0, 1.0, 1.0),
        flops=(1, 0, 1, 0, 1, 1),
        fw_outputs=(2,),
        bw_outputs=(5,),
        tangents=(3,),
    )


def test_close_keeps_the_owner_and_recomputes_its_view():
    p = _value_and_view()
    assert schedule.close(p, (0, 1)) == ((0,), (1,))
    assert schedule.close(p, (1,)) == ((1,), (0,))  # one alias kept alone stays kept


def test_no_solver_keeps_a_value_and_its_view():
    p = _value_and_view()
    for name in SOLVERS:
        assert solve(p, None, name).kept in ((), (0,), (1,)), name


def test_a_view_of_a_user_output_may_stay_kept_with_it():
    # Saved tensors that alias a user output are not donated: nothing to consolidate.
    p = _value_and_view()
    held = RematProblem(**{**p.__dict__, "fw_outputs": (0, 2)})
    assert schedule.close(held, (0, 1)) == ((0, 1), ())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_every_solver_keeps_one_value_per_donated_storage(p, data):
    """Random DAGs with views and tags: no plan of any solver keeps two aliases of a storage the
    backward may overwrite, unless both are tagged so they cannot be recomputed."""
    if not valid_rules(p):
        return
    budget = data.draw(st.one_of(st.none(), st.integers(0, 60)))
    forced = set(p.never_recompute) | set(p.must_save)
    for name in SOLVERS:
        d = solve(p, budget, name, SolveOptions(time_limit=30.0))
        for members in schedule.alias_groups(p, d.kept).values():
            assert len(members) == 1 or all(v in forced for v in members), (name, members, d)


# --------------------------------------------------------------------------
# The planner's check on the programs that run
# --------------------------------------------------------------------------


def _programs(fw, bw, *args):
    return make_fx(fw, tracing_mode="fake")(*args[:1]), make_fx(bw, tracing_mode="fake")(*args[1:])


def test_the_check_names_two_saved_aliases():
    def fw(x):
        h = x * 2
        return h.sum(), h, h.view(-1)  # user output, then two saved aliases of h

    def bw(h, v, t):
        return (h * t + v.view(h.shape),)

    x = torch.randn(4, 4)
    gfw, gbw = _programs(fw, bw, x, x, x.view(-1), torch.tensor(1.0))
    with pytest.raises(PlanInvariantError, match=r"\(mul, view\)"):
        check_saved_aliases(gfw, gbw, 1)


def test_the_check_accepts_aliases_of_a_user_output():
    def fw(x):
        h = x * 2
        return h, h.view(-1)  # h is returned to the user: not donated

    def bw(v, t):
        return (t * v.view(t.shape),)

    x = torch.randn(4, 4)
    gfw, gbw = _programs(fw, bw, x, x.view(-1), x)
    check_saved_aliases(gfw, gbw, 1)


# --------------------------------------------------------------------------
# End to end under Inductor
# --------------------------------------------------------------------------


class ViewAndBase(nn.Module):
    """The smallest model that showed the bug: a value read through a view by a matmul
    whose gradient arrives late, and directly by a pointwise product whose gradient
    Inductor writes into the value's (donated) buffer first."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 32), requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(32, 32))
        self.w3 = nn.Parameter(torch.randn(32, 32))
        self.c = nn.Parameter(torch.randn(4, 8, 32))

    def forward(self, x):
        h = x @ self.w1
        p = torch.tanh(h.view(-1, 32) @ self.w2) @ self.w3
        q = h * self.c
        return p.square().sum() + 3 * q.sum()


def _grads_match_eager(model, *inputs, **options):
    ref = copy.deepcopy(model)
    ref(*inputs).backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxremat", options=options or None)
    compiled(*inputs).backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-4, msg=f"gradient of {name}")


def test_a_saved_value_and_its_view_under_inductor():
    """Failed before the fix: the gradient of w2 had relative error 2.0 (Inductor wrote the
    gradient of c into h's buffer, then read h's saved view for w2's gradient)."""
    torch.manual_seed(0)
    _grads_match_eager(ViewAndBase(), torch.randn(4, 8, 16))


class RandomAliases(nn.Module):
    """Blocks over a (batch, tokens, width) activation whose values the backward reads both
    directly and through views (reshapes, transposes, slices), with in-place ops between."""

    def __init__(self, spec, width: int) -> None:
        super().__init__()
        self.spec = spec
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width**0.5) for _ in spec)
        self.scales = nn.ParameterList(nn.Parameter(torch.randn(width)) for _ in spec)

    def forward(self, x):
        b, s, d = x.shape
        total = 0
        for (kind, late), w, c in zip(self.spec, self.mats, self.scales):
            h = torch.relu(x @ w) if kind == "relu" else x @ w
            if kind == "inplace":
                h = h.clone()
                h.mul_(1.5)
            through_view = {
                "reshape": lambda t: t.reshape(b * s, d) @ w,
                "transpose": lambda t: (t.transpose(1, 2) @ t).sum(-1),
                "slice": lambda t: t[:, 1:] @ w,
            }[late if late in ("reshape", "transpose", "slice") else "reshape"](h)
            total = total + 2.5 * (h * c).sum() + torch.tanh(through_view).square().sum()
            x = h + x
        return total + x.square().mean()


@settings(
    max_examples=INDUCTOR_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.lists(
        st.tuples(st.sampled_from(("mm", "relu", "inplace")), st.sampled_from(("reshape", "transpose", "slice"))),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from((None, "least")),
)
def test_random_aliases_under_inductor(spec, budget):
    """Random graphs built to save a value and views of it: gradients equal eager's under Inductor."""
    torch.manual_seed(0)
    model = RandomAliases(spec, 16)
    x = torch.randn(2, 8, 16)
    options = {} if budget is None else {"budget": 1, "on_infeasible": "min"}
    with pytest.warns(UserWarning, match="least-memory") if budget else _nothing():
        _grads_match_eager(model, x, **options)
    assert fxremat.plans()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------
# verify: the opt-in self-check catches this class when the guard is off
# --------------------------------------------------------------------------


def test_verify_passes_a_correct_plan():
    torch.manual_seed(0)
    _grads_match_eager(ViewAndBase(), torch.randn(4, 8, 16), verify=True)


@pytest.mark.parametrize("name,inner", [("dropout", "eager"), ("inplace_views", "eager"), ("dropout", "inductor")])
def test_verify_replays_randomness_and_leaves_the_step_alone(name, inner):
    """Dropout masks are drawn under the same RNG state in both checked runs and again in the
    real step, and in-place ops mutate only the checked copies: the step equals the same
    compile without verify (Inductor draws its own masks, so eager is the reference only
    under inner="eager")."""
    from zoo import ZOO

    base, inputs = ZOO[name]()
    base.train()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    if inner == "eager":
        torch.manual_seed(0)
        ref_loss = ref(*inputs)
    else:
        torch._dynamo.reset()
        torch.manual_seed(0)
        ref_loss = torch.compile(ref, backend="fxremat")(*inputs)
    ref_loss.backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxremat", options={"verify": True, "inner": inner})
    torch.manual_seed(0)
    loss = compiled(*inputs)
    loss.backward()
    compare(ref, ref_loss, model, loss)


def test_verify_names_the_wrong_gradient(monkeypatch):
    """With the one-value-per-storage rule and the program check switched off, the bug
    is back and verify stops the step before it runs, naming the parameter."""
    from fxremat import planner

    monkeypatch.setattr(schedule, "one_per_storage", lambda problem, kept: kept)
    monkeypatch.setattr(schedule, "alias_groups", lambda problem, values: {})
    monkeypatch.setattr(planner, "check_saved_aliases", lambda fw, bw, n: None)
    torch.manual_seed(0)
    model = ViewAndBase()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxremat", options={"verify": True})
    with pytest.raises(fxremat.VerificationError, match=r"gradient of w2 differs"):
        compiled(torch.randn(4, 8, 16))
    assert all(p.grad is None for p in model.parameters())  # nothing ran for real
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_verify_is_validated_and_read_from_the_environment(monkeypatch):
    with pytest.raises(TypeError, match="verify='yes' must be True or False"):
        fxremat.Options.from_mapping({"verify": "yes"})
    monkeypatch.setenv("FXREMAT_VERIFY", "1")
    assert fxremat.Options.from_mapping({}).verify
    assert not fxremat.Options.from_mapping({"verify": False}).verify
    monkeypatch.setenv("FXREMAT_VERIFY", "0")
    assert not fxremat.Options.from_mapping({}).verify
