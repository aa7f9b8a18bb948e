"""The package's shape stays readable: pipeline folders, one-way imports, small modules and functions."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dynaflow_fn"

STAGES = ["ir", "tracing", "transforms", "passes", "plan", "lowering", "runtime", "distributed", "jitting"]
"""The pipeline, earliest first: a module may import its own stage and earlier ones, never a later one.
`distributed` is the collectives library model code calls and the check that ranks agree on a plan,
which df.jit runs before a plan's first call."""

UTILITIES = {"errors", "compat"}
FRONT_ENDS = {"pure", "autodiff", "optim", "dynamo", "testing"}
"""What users call: these may import any stage (and nothing in a stage imports them)."""

MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_LOOSE_MODULES = 400, 200, 60, 8


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _part(path: pathlib.Path) -> str:
    """The top-level folder or module of the package a file belongs to."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_parts(path: pathlib.Path) -> set[str]:
    """The package parts a module imports, relative or absolute."""
    depth = len(path.relative_to(PACKAGE).parts) - 1
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = node.level - 1
                if up < depth:                      # stays inside this file's own folder
                    found.add(_part(path))
                    continue
                names = (node.module or "").split(".") if node.module else [a.name for a in node.names]
                found.update([names[0]] if node.module else names)
            elif node.module and node.module.startswith("dynaflow_fn."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("dynaflow_fn."))
    return found


def test_the_top_level_holds_few_loose_modules():
    loose = [p.name for p in PACKAGE.glob("*.py")]
    assert len(loose) <= MAX_LOOSE_MODULES, loose


@pytest.mark.parametrize("path", [p for p in _modules() if _part(p) in STAGES],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_stage_imports_a_later_stage_or_a_front_end(path):
    stage = STAGES.index(_part(path))
    for part in _imported_parts(path):
        assert part not in FRONT_ENDS, f"{path.relative_to(PACKAGE)} imports the front end {part}"
        if part in STAGES:
            assert STAGES.index(part) <= stage, f"{path.relative_to(PACKAGE)} imports the later stage {part}"


def test_modules_classes_and_functions_stay_small():
    too_big = []
    for path in _modules():
        source = path.read_text()
        name = str(path.relative_to(PACKAGE))
        if source.count("\n") > MAX_MODULE_LINES:
            too_big.append(f"module {name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_big.append(f"class {name}:{node.name}: {lines} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                too_big.append(f"function {name}:{node.name}: {lines} lines")
    assert not too_big, "\n".join(too_big)


def test_every_exception_class_of_the_package_lives_in_errors():
    defined_elsewhere = []
    for path in _modules():
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(base, ast.Name) and (base.id.endswith("Error") or base.id == "Exception")
                    for base in node.bases):
                defined_elsewhere.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert not defined_elsewhere, defined_elsewhere
