"""The public namespaces hold the API and nothing else, and help() explains each transform in full."""

import pydoc
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
