"""Graph breaks fxremat removes before Dynamo traces a model.

A graph break splits the step into graphs that fxremat plans one at a time; what
crosses the break exists whole. ``transformers`` calls ``logger.warning_once`` inside
the forward of models whose class names no loss (``GPT2LMHeadModel`` warns that
``loss_type=None`` falls back to ``ForCausalLMLoss``), and Dynamo breaks the graph at
every logging call. The LM head and its loss then land in two graphs: the logits
cross the break whole and their gradient comes back whole, so chunking the loss
(``chunking.py``) cannot shrink them.

Dynamo traces such a call as a no-op where the function is in its
``ignore_logging_functions``; the warning is then not printed from compiled code
(it says once that the default loss is used). The setting is Dynamo's and global to
the process: a plain ``torch.compile`` that runs after fxremat was loaded traces
through the same calls. It is made when fxremat is loaded, or, where ``transformers``
is imported later, as soon as its logging module is: the graphs do not depend on the
order of the imports, nor on a reset of Dynamo (which keeps Dynamo's config).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types

from ._torch_compat import trace_through_logging_function

__all__ = ["trace_through_hf_warnings", "install"]

log = logging.getLogger(__name__)

# transformers' module defining ``warning_once`` (set on ``logging.Logger`` when it is imported).
HF_LOGGING = "transformers.utils.logging"


def trace_through_hf_warnings() -> bool:
    """Let Dynamo trace through ``transformers``' ``logger.warning_once`` where ``transformers`` is
    imported; True when this call did it.

    Example:
        >>> trace_through_hf_warnings()  # GPT2LMHeadModel(...)(input_ids=..., labels=...) is one graph
    """
    module = sys.modules.get(HF_LOGGING)
    warning_once = getattr(module, "warning_once", None)
    if warning_once is None or not trace_through_logging_function(warning_once):
        return False
    log.info("fxremat: Dynamo traces through transformers' logger.warning_once (no graph break there)")
    return True


class _ThenTrace(importlib.abc.Loader):
    """``transformers``' logging module's own loader, then ``trace_through_hf_warnings``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # The module keeps its own loader (resources, reloads); this one only runs once.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        trace_through_hf_warnings()


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds ``transformers``' logging module with the other finders and wraps its loader (once)."""

    def find_spec(self, fullname: str, path, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != HF_LOGGING:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _ThenTrace(spec.loader)
            return spec
        return None


def install() -> None:
    """Let Dynamo trace through ``transformers``' warnings: now where it is imported, else as soon as
    it is (once per process)."""
    if trace_through_hf_warnings() or HF_LOGGING in sys.modules:
        return
    if not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())
