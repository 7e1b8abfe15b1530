"""Write docs/API.md, the API reference, from fxremat's docstrings.

Usage:
    .venv/bin/python docs/gen_api.py            # rewrites docs/API.md (also: make docs)
    .venv/bin/python docs/gen_api.py OUT.md     # writes elsewhere

Every name in ``fxremat.__all__`` must sit in exactly one group of ``GROUPS``
(a new export without a place here is an error), and tests/test_api_docs.py
fails while docs/API.md differs from what this script writes. Docstrings are
Google style; the sections ``Args``, ``Attributes``, ``Raises``, ``Returns``
and ``Example`` become Markdown lists, paragraphs and code blocks.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

import fxremat
import fxremat.solvers
from fxremat.solvers.registry import SOLVERS

OUT = Path(__file__).resolve().parent / "API.md"

# Signatures longer than this are broken one parameter per line (black's width).
LINE_WIDTH = 88


@dataclasses.dataclass(frozen=True)
class Group:
    title: str
    intro: str
    names: tuple[str, ...]
    """Names in ``fxremat.__all__``, documented as ``fxremat.NAME``."""
    extras: tuple[str, ...] = ()
    """Objects outside ``__all__`` a user meets through the names above, as ``module:name``."""


GROUPS = (
    Group(
        "Compiling",
        'Use `torch.compile(model, backend="fxremat", options={...})` (the name is registered '
        "through the `torch_dynamo_backends` entry point, so no import is needed), or bind the "
        "options in Python with `fxremat.backend(...)`. The options are the fields of "
        "[`Options`](#class-fxrematoptions).",
        ("backend",),
        ("fxremat.backend:fxremat_backend",),
    ),
    Group(
        "Planning and inspecting",
        "Plan a step without training, read what was kept and recomputed, and explore the memory/time trade-off.",
        ("explain", "pareto", "ParetoPoint", "Plan", "plans", "running_plans", "clear_plans"),
        ("fxremat.plan:ValueRecord", "fxremat.plan:NodeRecord"),
    ),
    Group(
        "Measuring",
        "Measure a step's real peak memory, the quantity the budget bounds.",
        ("measure", "Measurement"),
    ),
    Group(
        "Options, budgets and errors",
        "",
        ("Options", "parse_budget", "format_bytes", "BudgetError", "VerificationError", "SolveTimeout"),
    ),
)

SECTIONS = {
    "Args": "Args",
    "Arguments": "Args",
    "Attributes": "Attributes",
    "Raises": "Raises",
    "Returns": "Returns",
    "Yields": "Yields",
    "Example": "Example",
    "Examples": "Example",
    "Note": "Note",
    "Notes": "Note",
}
LIST_SECTIONS = ("Args", "Attributes", "Raises")
_SECTION = re.compile(r"^(%s):\s*$" % "|".join(SECTIONS))
_ENTRY = re.compile(r"^(\S[^:]*?):\s*(.*)$")
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc):`~?([^`]+)`")


# ---------------------------------------------------------------------------
# Docstrings
# ---------------------------------------------------------------------------


def inline(text: str) -> str:
    """reST inline markup to Markdown: ``code`` and :role:`name` become `code`."""
    text = _ROLE.sub(r"`\1`", text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


def split_sections(doc: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The free text before the first section, then (section, dedented body lines).

    Text after a section's body (back at the left margin) comes as a section named "".
    """
    lines = doc.splitlines()
    head: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(lines):
        m = _SECTION.match(lines[i])
        if not m:
            if sections and sections[-1][0] == "":
                sections[-1][1].append(lines[i])
            elif sections:
                sections.append(("", [lines[i]]))
            else:
                head.append(lines[i])
            i += 1
            continue
        body: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
            body.append(lines[i])
            i += 1
        sections.append((SECTIONS[m.group(1)], textwrap.dedent("\n".join(body)).strip("\n").splitlines()))
    return head, sections


def entries(body: list[str]) -> list[tuple[str, str]]:
    """``name: text`` entries of an Args/Attributes/Raises body; indented lines continue one."""
    out: list[tuple[str, str]] = []
    for line in body:
        if line and not line[0].isspace():
            m = _ENTRY.match(line)
            if m:
                out.append((m.group(1), m.group(2).strip()))
                continue
        if out and line.strip():
            name, text = out[-1]
            out[-1] = (name, f"{text} {line.strip()}".strip())
    return out


def render_doc(doc: str | None, skip: tuple[str, ...] = ()) -> str:
    """A cleaned docstring as Markdown; sections named in ``skip`` are left out."""
    if not doc:
        return ""
    head, sections = split_sections(inspect.cleandoc(doc))
    parts = [inline("\n".join(head).strip())]
    for name, body in sections:
        if name in skip:
            continue
        if name in LIST_SECTIONS:
            items = [f"- `{key}`: {inline(text)}" for key, text in entries(body)]
            parts.append(f"**{name}:**\n\n" + "\n".join(items))
        elif name == "Example":
            parts.append(f"**{name}:**\n\n```python\n" + "\n".join(body) + "\n```")
        elif name == "":
            parts.append(inline("\n".join(body).strip()))
        else:
            parts.append(f"**{name}:** " + inline("\n".join(body)))
    return "\n\n".join(p for p in parts if p)


def attribute_docs(cls: type) -> dict[str, str]:
    """Field descriptions of a class: its docstring's Attributes, then string literals under fields."""
    found: dict[str, str] = {}
    for section, body in split_sections(inspect.cleandoc(cls.__doc__ or ""))[1]:
        if section == "Attributes":
            for key, text in entries(body):
                for name in key.split(" / "):
                    found[name.strip()] = text
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return found
    stmts: list[ast.stmt] = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for prev, node in zip(stmts, stmts[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.setdefault(prev.target.id, " ".join(inspect.cleandoc(node.value.value).split()))
    return found


# ---------------------------------------------------------------------------
# Signatures
# ---------------------------------------------------------------------------


class _Raw:
    """An annotation shown as written (``from __future__ import annotations`` makes them strings)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _annotation(a: object) -> object:
    if a is inspect.Parameter.empty:
        return a
    text = a if isinstance(a, str) else inspect.formatannotation(a)
    # A forward reference written in quotes ("Options") under PEP 563 keeps its quotes.
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return _Raw(text)


def _default(d: object) -> object:
    if d is inspect.Parameter.empty:
        return d
    text = repr(d)
    # An address would change the page on every run.
    return _Raw("..." if " at 0x" in text else text)


def signature(obj: object, name: str, *, method: bool = False) -> str:
    """``name(params) -> ret``, broken one parameter per line when long; ``method`` drops self/cls."""
    if not callable(obj):
        return name
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = [
        p.replace(annotation=_annotation(p.annotation), default=_default(p.default)) for p in sig.parameters.values()
    ]
    if method and params and params[0].name in ("self", "cls"):
        params = params[1:]
    sig = sig.replace(parameters=params, return_annotation=_annotation(sig.return_annotation))
    text = f"{name}{sig}"
    if len(text) <= LINE_WIDTH:
        return text
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {sig.return_annotation!r}"
    args = _split_params(str(sig.replace(return_annotation=inspect.Signature.empty))[1:-1])
    return f"{name}(\n" + "".join(f"    {a.strip()},\n" for a in args) + f"){ret}"


def _split_params(args: str) -> list[str]:
    """Split a rendered parameter list on the commas outside brackets and quotes."""
    out, depth, quote, current = [], 0, "", ""
    for ch in args:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(current)
            current = ""
            continue
        current += ch
    out.append(current)
    return out


# ---------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_fields(cls: type) -> str:
    """A dataclass's fields as a table: name, type, default, description."""
    docs = attribute_docs(cls)
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f"`{_cell(repr(f.default))}`"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"`{_cell(getattr(f.default_factory, '__name__', 'factory'))}()`"
        else:
            default = "required"
        kind = f.type if isinstance(f.type, str) else inspect.formatannotation(f.type)
        rows.append(f"| `{f.name}` | `{_cell(kind)}` | {default} | {_cell(inline(docs.get(f.name, '')))} |")
    return "\n".join(rows)


def public_members(cls: type) -> list[tuple[str, object]]:
    """Methods, class methods and properties a class defines itself, in source order."""
    out: list[tuple[str, object]] = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (classmethod, staticmethod)):
            out.append((name, member.__func__))
        elif isinstance(member, property) or inspect.isfunction(member):
            out.append((name, member))
    return out


def render_object(qualname: str, obj: object) -> str:
    """One function or class: heading, signature, docstring (and fields and methods for classes)."""
    parts: list[str] = []
    if inspect.isclass(obj):
        parts.append(f"### class `{qualname}`")
        if dataclasses.is_dataclass(obj):
            parts.append(render_doc(obj.__doc__, skip=("Attributes",)))
            parts.append(render_fields(obj))
        else:
            bases = ", ".join(b.__name__ for b in obj.__bases__ if b is not object)
            parts.append(f"```python\n{signature(obj, qualname)}\n```")
            if bases:
                parts.append(f"Bases: `{bases}`.")
            parts.append(render_doc(obj.__doc__))
        for name, member in public_members(obj):
            short = f"{obj.__name__}.{name}"
            if isinstance(member, property):
                parts.append(f"#### property `{short}`\n\n" + render_doc(member.__doc__))
            else:
                parts.append(
                    f"#### `{short}`\n\n```python\n{signature(member, short, method=True)}\n```\n\n"
                    + render_doc(member.__doc__)
                )
    else:
        parts.append(f"### `{qualname}`")
        parts.append(f"```python\n{signature(obj, qualname)}\n```")
        parts.append(render_doc(inspect.getdoc(obj)))
    return "\n\n".join(p for p in parts if p)


def render_solvers() -> str:
    """The solver registry: a table of names, then each solver's docstring."""
    rows = ["| `solver=` | function | what it does |", "|---|---|---|"]
    for name, fn in SOLVERS.items():
        summary = inline(inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0].replace("\n", " "))
        rows.append(f"| `{name}` | `{fn.__module__}.{fn.__qualname__}` | {_cell(summary)} |")
    parts = [
        "## Solvers",
        "The `solver` option names one of `fxremat.solvers.SOLVERS`. Every solver is a pure function "
        "`(problem, budget, options) -> Decision` that never imports torch; it returns the fastest plan "
        "it finds whose simulated peak fits, else its least-peak plan with `feasible=False` (it never "
        "raises for infeasibility).",
        "\n".join(rows),
        render_object("fxremat.solvers.solve", fxremat.solvers.solve),
        render_object("fxremat.solvers.Decision", fxremat.solvers.Decision),
    ]
    for name, fn in SOLVERS.items():
        parts.append(render_object(f"{fn.__module__}.{fn.__qualname__}", fn).replace("### ", f'### `"{name}"`: ', 1))
    return "\n\n".join(parts)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def render() -> str:
    """The whole page."""
    exported = [n for n in fxremat.__all__ if n != "__version__"]
    placed = [n for g in GROUPS for n in g.names]
    missing = sorted(set(exported) - set(placed))
    unknown = sorted(set(placed) - set(exported))
    twice = sorted({n for n in placed if placed.count(n) > 1})
    if missing or unknown or twice:
        raise ValueError(
            f"docs/gen_api.py GROUPS is out of step with fxremat.__all__: not placed {missing}, "
            f"not exported {unknown}, placed twice {twice}; edit GROUPS"
        )
    out = [
        "<!-- Generated by docs/gen_api.py from the docstrings; do not edit by hand. "
        "Regenerate with `make docs` (or `.venv/bin/python docs/gen_api.py`). -->",
        "# fxremat API reference",
        inline(inspect.cleandoc(fxremat.__doc__ or "").split("\n\n")[:2][-1].replace("\n", " ")),
        f"Version `{fxremat.__version__}` (`fxremat.__version__`). Options, budgets and the plan "
        "format are explained in [CONCEPTS.md](CONCEPTS.md) and [PLAN_SCHEMA.md](PLAN_SCHEMA.md).",
        "\n".join(f"- [{g.title}](#{_anchor(g.title)}): " + ", ".join(f"`{n}`" for n in g.names) for g in GROUPS)
        + "\n- [Solvers](#solvers): "
        + ", ".join(f"`{n}`" for n in SOLVERS),
    ]
    for g in GROUPS:
        out.append(f"## {g.title}")
        if g.intro:
            out.append(g.intro)
        for n in g.names:
            out.append(render_object(f"fxremat.{n}", getattr(fxremat, n)))
        for extra in g.extras:
            # By module path: ``fxremat.backend`` the attribute is the function, not the module.
            module, n = extra.split(":")
            out.append(render_object(f"{module}.{n}", getattr(importlib.import_module(module), n)))
    out.append(render_solvers())
    text = "\n\n".join(out)
    # No trailing spaces, one newline at the end.
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(args[0]) if args else OUT
    path.write_text(render(), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
