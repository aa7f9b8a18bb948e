"""The package's shape stays readable: pipeline folders, one-way imports, small modules and functions,
and tests that mirror the folders."""

import ast
import builtins
import collections
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dynaflow_fn"
TESTS = pathlib.Path(__file__).resolve().parent

STAGES = ["ir", "tracing", "transforms", "passes", "plan", "lowering", "runtime", "distributed", "jitting"]
"""The pipeline, earliest first: a module may import its own stage and earlier ones, never a later one.
`distributed` is the collectives library model code calls and the check that ranks agree on a plan,
which df.jit runs before a plan's first call."""

UTILITIES = {"errors", "compat", "native"}
FRONT_ENDS = {"pure", "autodiff", "optim", "dynamo", "testing"}
"""What users call: these may import any stage (and nothing in a stage imports them)."""

MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_LOOSE_MODULES = 400, 200, 60, 8

MAX_TOP_LEVEL_TEST_FILES = 8
"""tests/test_*.py is for what concerns the whole package (its architecture, packaging, public API,
README, examples, guarantees and errors); a test of one folder's code lives in tests/<folder>/."""

TEST_FOLDERS_BEYOND_THE_PACKAGE_FOLDERS = {
    "front_ends": "the loose front-end modules pure.py, autodiff.py and optim.py",
    "distributed": "the loose module distributed.py: collectives on two processes",
    "bench": "the repository's benchmarks, bench/, on a machine without a GPU",
}
"""The folders of tests/ that are not named after a folder of the package, and what each tests."""


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


def _package_folders() -> set[str]:
    return {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}


def _test_folders() -> set[str]:
    return {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}


def test_the_top_level_of_tests_holds_few_test_files():
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert len(top) <= MAX_TOP_LEVEL_TEST_FILES, f"move a test of one folder's code to tests/<folder>/: {top}"


def test_the_test_folders_mirror_the_package_folders():
    folders, package = _test_folders(), _package_folders()
    unexplained = folders - package - set(TEST_FOLDERS_BEYOND_THE_PACKAGE_FOLDERS)
    assert not unexplained, (f"tests/{sorted(unexplained)} names no folder of dynaflow_fn/: rename it after the "
                             "folder it tests, or add it to TEST_FOLDERS_BEYOND_THE_PACKAGE_FOLDERS with what it tests")
    assert not package - folders, f"no tests/ folder for the package folders {sorted(package - folders)}"


def test_no_two_test_modules_share_a_file_name():
    """tests/ and its folders are not packages: pytest imports every test module (and `from fixtures
    import ...`) by its file name alone, so two test files of one name would clash."""
    counts = collections.Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [name for name, count in counts.items() if count > 1], counts.most_common(3)


@pytest.mark.parametrize("path", [p for p in _modules() if _part(p) in STAGES],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_stage_imports_a_later_stage_or_a_front_end(path):
    stage = STAGES.index(_part(path))
    for part in _imported_parts(path):
        assert part not in FRONT_ENDS, f"{path.relative_to(PACKAGE)} imports the front end {part}"
        if part in STAGES:
            assert STAGES.index(part) <= stage, f"{path.relative_to(PACKAGE)} imports the later stage {part}"


def test_the_native_checks_import_only_errors_and_ir_and_only_runtime_and_jitting_import_them():
    native = [p for p in _modules() if _part(p) == "native"]
    assert native and all(_imported_parts(p) <= {"native", "errors", "ir"} for p in native)
    importers = {_part(p) for p in _modules() if _part(p) != "native" and "native" in _imported_parts(p)}
    assert importers <= {"runtime", "jitting"}, importers


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


# --- private torch internals live in compat ---------------------------------------------------------

TORCH_NAMESPACES_OF_OPS = ("torch.ops.",)
"""Attribute chains under these are operator names (`torch.ops._c10d_functional.all_reduce`), not internals."""

PRIVATE_BY_CONTRACT = {"cdata", "tracer", "experimental"}
"""Names without a leading underscore that still reach torch internals: a StorageWeakRef's raw storage
pointer, a proxy mode's tracer, and `torch.fx.experimental`."""


def _is_private(name: str) -> bool:
    return (name.startswith("_") and not name.startswith("__")) or name in PRIVATE_BY_CONTRACT


def _is_foreach_op(name: str) -> bool:
    return name.startswith("_foreach_")


def _names_the_package_defines(paths: list[pathlib.Path]) -> set[str]:
    """Every name a module of the package binds (functions, classes, variables, attributes, parameters):
    a private attribute with one of these names is the package's own, not torch's."""
    defined = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.alias):
                defined.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                defined.add(node.args[1].value)
    return defined - PRIVATE_BY_CONTRACT


def _torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to torch modules (`import torch as _torch`, `import torch.distributed as dist`)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`torch.ops.aten.mm` for an attribute chain rooted at a torch module, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def private_torch_uses(path: pathlib.Path, defined: set[str]) -> list[str]:
    """The places in one module that reach a private torch internal: an import of a private torch module
    or name, a private attribute of a torch module, and a private attribute (or getattr/hasattr of one)
    that the package does not define itself, read on any object torch hands back (`op._schema`)."""
    tree = ast.parse(path.read_text())
    aliases = _torch_aliases(tree)
    found, covered = [], set()
    for node in ast.walk(tree):
        if node in covered:
            continue
        where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names = node.module.split(".") + [a.name for a in node.names]
            found += [f"{where}: from {node.module} import {a.name}" for a in node.names
                      if any(_is_private(n) for n in names)][:1]
        elif isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(_is_private(n) for n in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            covered.update(n for n in ast.walk(node.value) if isinstance(n, ast.Attribute))   # one report a chain
            dotted = _dotted(node, aliases)
            if dotted is not None:
                if not dotted.startswith(TORCH_NAMESPACES_OF_OPS) and not _is_foreach_op(node.attr):
                    found.append(f"{where}: {dotted}")
            elif node.attr not in defined and not _is_foreach_op(node.attr):
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value) \
                and node.args[1].value not in defined:
            found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_private_torch_internals_are_reached_only_through_compat():
    outside = [p for p in _modules() if _part(p) != "compat"]
    defined = _names_the_package_defines(outside)
    uses = [use for path in outside for use in private_torch_uses(path, defined)]
    assert not uses, "reach these through dynaflow_fn.compat (each with a fallback):\n" + "\n".join(uses)


def test_the_private_torch_check_finds_what_it_is_for(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import torch\nimport torch as _t\nfrom torch._subclasses import fake_tensor\n"
                      "from torch.fx.experimental.proxy_tensor import get_proxy_mode\n"
                      "a = op._schema.name\nb = _t._C._get_tracing_state\nc = getattr(op, '_overloadname')\n"
                      "d = ref.cdata\ne = torch.ops._c10d_functional.all_reduce\nf = _t._foreach_add\n"
                      "g = self._own\nself._own = 1\n")
    global PACKAGE
    package, PACKAGE = PACKAGE, tmp_path
    try:
        uses = private_torch_uses(module, _names_the_package_defines([module]))
    finally:
        PACKAGE = package
    assert sorted(int(use.split(":")[1]) for use in uses) == [3, 4, 5, 6, 7, 8], uses


# --- every error is one of errors.py's classes -----------------------------------------------------

BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}


def builtin_raises(path: pathlib.Path) -> list[str]:
    """`raise ValueError(...)` and the like: raises of a builtin exception class in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id in BUILTIN_EXCEPTIONS:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: raise {raised.id}")
    return found


def test_every_raise_is_one_of_the_package_error_classes():
    raises = [r for path in _modules() for r in builtin_raises(path)]
    assert not raises, "raise a class of dynaflow_fn/errors.py instead:\n" + "\n".join(raises)


LATER_CALL_FILES = {"jitting/jitted.py", "jitting/guard.py", "jitting/replayer.py"}
"""The package's files a call that the last plan's guard admits runs Python in, before its runtime: the
path to read when a call is slow. What it reads from torch it reads through torch's C functions, which
compat/calls.py hands out, so that file runs no Python on the way. (A static leaf the C++ guard leaves to Python, a zero or NaN float
or a dataclass, adds `ir/tree.py`, where its key is defined.)"""

RUNTIME_FILES = {"eager": {"runtime/eager.py", "runtime/turns.py", "runtime/interpreter.py", "plan/plan.py"},
                 "cudagraph": {"runtime/cudagraph.py", "runtime/copy_in.py", "runtime/turns.py", "runtime/handouts.py"}}


def _package_files_crossed(call):
    crossed = set()

    def profile(frame, event, arg):
        path = pathlib.Path(frame.f_code.co_filename)
        if event == "call" and PACKAGE in path.parents:
            crossed.add(path.relative_to(PACKAGE).as_posix())

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return crossed


def _jitted_model(device, backend):
    import torch
    from torch import nn

    import dynaflow_fn as df

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).to(device)
    params = {"w": torch.randn(8, 8, device=device), "b": torch.randn(8, device=device)}
    fast = df.jit(lambda params, x, scale: model(x @ params["w"] + params["b"]) * scale, backend=backend)
    return fast, params, torch.randn(4, 8, device=device)


def _later_call_files(device, backend, grad):
    import torch

    fast, params, x = _jitted_model(device, backend)
    with torch.set_grad_enabled(grad):
        fast(params, x, 0.5)
        fast(params, x, 0.5)
        return _package_files_crossed(lambda: fast(params, torch.randn(4, 8, device=device), 0.5))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_later_call_crosses_three_files_before_its_runtime(grad):
    crossed = _later_call_files("cpu", "eager", grad)
    assert "jitting/jitted.py" in crossed and crossed - RUNTIME_FILES["eager"] <= LATER_CALL_FILES, crossed


def test_a_first_call_crosses_at_most_nine_files_of_jitting():
    fast, params, x = _jitted_model("cpu", "eager")
    crossed = _package_files_crossed(lambda: fast(params, x, 0.5))
    jitting = {path for path in crossed if path.startswith("jitting/")}
    assert "jitting/pipeline.py" in jitting and len(jitting) <= 9, sorted(jitting)


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_later_call_on_the_cudagraph_runtime_crosses_seven_files(grad):
    """The three before the runtime, the runtime, the copies of its copied-in inputs, its turn-taking
    lock and the count of who holds the outputs it hands out."""
    crossed = _later_call_files("cuda", "cudagraph", grad)
    assert "runtime/cudagraph.py" in crossed and crossed <= LATER_CALL_FILES | RUNTIME_FILES["cudagraph"], crossed
