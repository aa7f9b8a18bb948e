"""The optional test dependency: hypothesis, needed only by `strategies` and `check_scheduler`."""

from __future__ import annotations

from types import ModuleType

from ..errors import DynaflowError


def require_hypothesis() -> ModuleType:
    """The hypothesis module (with `hypothesis.strategies` loaded), or a DynaflowError saying how to install it."""
    try:
        import hypothesis
        import hypothesis.strategies  # noqa: F401  (loads the submodule)
    except ImportError:
        raise DynaflowError("dynaflow_fn.testing's random programs (strategies, check_scheduler) need hypothesis: "
                            "pip install hypothesis  (or pip install \"dynaflow-fn[test]\")") from None
    return hypothesis
