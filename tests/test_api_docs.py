"""docs/API.md is generated from the docstrings: it must match what docs/gen_api.py writes now."""

import importlib.util
import sys
from pathlib import Path

import pytest

import fxremat

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "regenerate it with `make docs` (or `.venv/bin/python docs/gen_api.py`) and commit docs/API.md"


def _gen_api():
    spec = importlib.util.spec_from_file_location("_fxremat_gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_api():
    return _gen_api()


def test_api_md_is_current(gen_api, tmp_path):
    out = tmp_path / "API.md"
    assert gen_api.main([str(out)]) == 0
    committed = (ROOT / "docs" / "API.md").read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8") == committed, f"docs/API.md is out of date with the docstrings; {REGENERATE}"


def test_every_export_is_documented(gen_api):
    text = gen_api.render()
    for name in fxremat.__all__:
        if name != "__version__":
            assert f"`fxremat.{name}`" in text, (
                f"fxremat.{name} is missing from the API page; add it to GROUPS in docs/gen_api.py"
            )


def test_render_is_deterministic(gen_api):
    assert gen_api.render() == gen_api.render()


def test_docstring_sections_become_markdown(gen_api):
    doc = """Do a thing with ``x``.

    Args:
        x: the input,
            continued here.
        **kw: passed on.

    Returns:
        The result.

    Example:
        >>> f(1)
        2

    Trailing prose.
    """
    md = gen_api.render_doc(doc)
    assert "Do a thing with `x`." in md
    assert "- `x`: the input, continued here." in md
    assert "- `**kw`: passed on." in md
    assert "**Returns:** The result." in md
    assert "```python\n>>> f(1)\n2\n```\n\nTrailing prose." in md


def test_long_signature_is_wrapped(gen_api):
    def f(alpha: int, beta: "str | None" = "a, b", *, gamma: dict = {}, delta=(1, 2), epsilon_long_name=None) -> int:
        return 0

    sig = gen_api.signature(f, "f")
    assert sig.splitlines()[0] == "f("
    assert "    beta: str | None = 'a, b'," in sig
    assert "    *," in sig
    assert sig.endswith(") -> int")
