"""What pyproject.toml promises a fresh install: one version, a license file, extras that cover the examples."""

import ast
import importlib.metadata
import os
import re
import sys

import pytest

import dynaflow_fn as df

tomllib = pytest.importorskip("tomllib")

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalized(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in requirements}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_package_version_is_the_one_pyproject_builds_with():
    project = _pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dynaflow_fn.__version__"}
    assert re.fullmatch(r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", df.__version__), df.__version__


def test_the_license_file_is_the_license_the_metadata_names():
    assert _pyproject()["project"]["license"] == "Apache-2.0"
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def _imported_top_level_modules(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_examples_extra_installs_everything_the_examples_import():
    project = _pyproject()["project"]
    installed = _requirement_names(project["dependencies"] + project["optional-dependencies"]["examples"])
    distributions = importlib.metadata.packages_distributions()
    examples = os.path.join(ROOT, "examples")
    missing = {}
    for name in sorted(os.listdir(examples)):
        if not name.endswith(".py"):
            continue
        for module in _imported_top_level_modules(os.path.join(examples, name)):
            if module in sys.stdlib_module_names or module == "dynaflow_fn":
                continue
            needed = {_normalized(d) for d in distributions.get(module, [module])}
            if not needed & installed:
                missing.setdefault(name, []).append(module)
    assert not missing, f"pip install -e '.[examples]' does not install what these examples import: {missing}"
