"""fxremat: train a PyTorch model inside a memory budget.

A graph-level rematerialization pass for ``torch.compile``: it captures the
joint forward+backward graph, prices every activation, and chooses what to
keep and what to recompute so the step's peak memory fits a budget in bytes
at the least recompute time.

Example:
    >>> compiled = torch.compile(model, backend="fxremat", options={"budget": "2GiB"})
    >>> compiled(x).sum().backward()
    >>> print(fxremat.plans()[-1])
"""

from .backend import backend
from .explain import ParetoPoint, explain, pareto
from .budget import BudgetError, format_bytes, parse_budget
from .measure import Measurement, measure
from .options import Options
from .plan import Plan
from .recorder import clear_plans, plans
from .steps import running_plans
from .verify import VerificationError
from .solvers.types import SolveTimeout

__version__ = "0.1.0"

__all__ = [
    "backend",
    "explain",
    "pareto",
    "ParetoPoint",
    "BudgetError",
    "VerificationError",
    "SolveTimeout",
    "Options",
    "Plan",
    "plans",
    "running_plans",
    "clear_plans",
    "parse_budget",
    "format_bytes",
    "measure",
    "Measurement",
    "__version__",
]
