"""The public namespaces hold the API and nothing else, and help() explains each transform in full."""

import dataclasses
import inspect
import pydoc
import re
import types

import pytest

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.transforms.schedule import STRATEGIES


@pytest.mark.parametrize("module", [df.optim, df.distributed], ids=lambda m: m.__name__)
def test_front_end_modules_export_their_api_and_no_imported_module(module):
    public = {name: value for name, value in vars(module).items() if not name.startswith("_")}
    assert not [name for name, value in public.items() if isinstance(value, types.ModuleType)]
    for name in module.__all__:
        value = getattr(module, name)
        assert getattr(value, "__module__", module.__name__).startswith("dynaflow_fn."), name
    namespace = {}
    exec(f"from {module.__name__} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(module.__all__)


def test_the_optimizers_are_the_optim_api():
    assert set(df.optim.__all__) == {"Optimizer", "adamw", "sgd"}


def test_help_on_partition_explains_every_rule_and_how_stages_are_cut():
    text = pydoc.render_doc(T.partition)
    assert "module docstring" not in text
    for rule in ("T.Op", "T.Module", "T.Region", "T.Kind"):
        assert rule in text
    for concept in ("merge=True", "tags", "first in `rules` wins", "matches no node warns", "before overlap"):
        assert concept in text, concept


def test_help_on_overlap_explains_every_strategy_and_option():
    text = pydoc.render_doc(T.overlap)
    assert "module docstring" not in text
    for name in STRATEGIES:
        assert f'"{name}"' in text, name
    for concept in ("df.Scheduler", "pick", "streams", "ScheduleError", "comm_ctas", "not partitioned"):
        assert concept in text, concept


def test_each_transforms_module_is_reachable_by_import_and_documents_its_transform():
    import importlib

    for module_name, transform in (("microbatching", T.microbatch), ("partitioning", T.partition),
                                   ("overlapping", T.overlap)):
        module = importlib.import_module(f"dynaflow_fn.transforms.{module_name}")
        assert module.__doc__ and getattr(module, transform.__name__) is transform
        exec(f"import dynaflow_fn.transforms.{module_name} as imported", namespace := {})
        assert namespace["imported"] is module


def _public_names() -> dict[str, object]:
    """Every public function and class of `df` and `T` (each once), by the name users write."""
    found: dict[int, tuple[str, object]] = {}
    for module, prefix in ((T, "T"), (df, "df")):
        for name in module.__all__:
            value = getattr(module, name)
            if not isinstance(value, types.ModuleType):
                found[id(value)] = (f"{prefix}.{name}", value)
    return dict(found.values())


PUBLIC = _public_names()
DOCUMENTED_WHERE_MADE = {df.Jitted: df.jit, df.CacheInfo: df.jit, df.CompileBackend: df.compile_backend}
"""Types users get from a function and never build themselves: that function documents their fields."""
READ_THROUGH_PRINT = {df.Program, df.Plan}
"""The IR records df.trace and df.lower return: users read them through print(); their fields are internals."""


def _documents(doc: str, name: str) -> bool:
    """Whether `doc` explains the parameter `name`: an entry (`name: ...`, or `a, name: ...`) or a
    mention in code (`name`, `fn(name)`)."""
    if re.search(rf"^\s*(\w+, )*{name}(, \w+)*:\s", doc, re.MULTILINE):
        return True
    return any(re.search(rf"\b{name}\b", code) for code in re.findall(r"`([^`]+)`", doc))


@pytest.mark.parametrize("name", [n for n, v in PUBLIC.items() if v not in READ_THROUGH_PRINT
                                  and not (isinstance(v, type) and issubclass(v, BaseException))])
def test_help_explains_every_parameter_of_every_public_function_and_class(name):
    value = PUBLIC[name]
    doc = inspect.getdoc(DOCUMENTED_WHERE_MADE.get(value, value)) or ""
    missing = [p for p in inspect.signature(value).parameters if not _documents(doc, p)]
    assert not missing, f"help({name}) does not explain {missing}"


@pytest.mark.parametrize("name", list(PUBLIC))
def test_help_says_where_what_it_refers_to_lives(name):
    doc = inspect.getdoc(PUBLIC[name]) or ""
    assert "module docstring" not in doc, f"help({name}) refers to a module docstring it does not show"
    bare = [ref for ref in re.findall(r"\b[Ss]ee `([^`]+)`", doc) if "." not in ref]
    assert not bare, f"help({name}) says 'see {bare}' without the module or namespace it is in"


def test_help_on_jit_gives_every_parameter_an_entry_of_its_own():
    doc = inspect.getdoc(df.jit)
    for name in inspect.signature(df.jit).parameters:
        assert re.search(rf"^{name}: \S", doc, re.MULTILINE), f"help(df.jit) has no entry '{name}: ...'"


def test_help_on_jit_shows_the_decorator_form_and_every_method_of_what_it_returns():
    doc = inspect.getdoc(df.jit)
    assert "@df.jit(donate_argnums=" in doc and "fast(*args, **kwargs)" in doc
    methods = [name for name, _ in inspect.getmembers(df.Jitted, inspect.isfunction) if not name.startswith("_")]
    assert {"cache_info", "clear_cache", "lower", "plans", "trace"} <= set(methods)
    assert not [m for m in methods if not re.search(rf"^fast\.{m}\(", doc, re.MULTILINE)]
    assert f"CacheInfo({', '.join(f.name for f in dataclasses.fields(df.CacheInfo))})" in doc
