"""Every Python snippet of README.md runs as written, and what it shows of the API and examples is theirs.

The rule for README.md: every ```python block is a complete program, run on its own in a fresh
process, started in an empty folder with the repository on the path (as from the repository's
root, where `examples/` can be imported). A block that defines `test_` functions is a test file,
run by pytest; a block that starts a process group says to run it under torchrun and runs so, on
two processes; every other block runs with python. What is not a program (output, a layout, a
signature) goes in another fence, and a ```text block that shows a call (`df.jit(...)`) must show
that function's signature.
"""

import ast
import inspect
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import dynaflow_fn as df
from dynaflow_fn import transforms as T

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"


def _blocks(language: str) -> list[tuple[str, str]]:
    """(the heading above it, its code) for every fenced block of `language`, in order."""
    lines = README.read_text().splitlines()
    blocks, heading, index = [], "top", 0
    while index < len(lines):
        fence = re.match(r"^\s*```(\w*)\s*$", lines[index])
        if fence:
            end = next(j for j in range(index + 1, len(lines)) if lines[j].strip() == "```")
            if fence[1] == language:
                blocks.append((heading, textwrap.dedent("\n".join(lines[index + 1:end])) + "\n"))
            index = end + 1
            continue
        if lines[index].startswith("#"):
            heading = re.sub(r"\W+", "-", lines[index].lstrip("#").strip()).strip("-").lower()
        index += 1
    return blocks


def _params(blocks: list[tuple[str, str]]) -> list:
    return [pytest.param(code, id=f"{number}-{heading}") for number, (heading, code) in enumerate(blocks)]


def _command(script: pathlib.Path, code: str) -> list[str]:
    if "init_process_group" in code:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    if re.search(r"^def test_", code, re.MULTILINE):
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    return [sys.executable, str(script)]


@pytest.mark.slow                                   # a process per block: seconds each, a minute or two in all
@pytest.mark.parametrize("code", _params(_blocks("python")))
def test_each_python_block_runs_as_written(code, tmp_path):
    is_test_file = re.search(r"^def test_", code, re.MULTILINE)
    script = tmp_path / ("test_snippet.py" if is_test_file else "snippet.py")
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "DYNAFLOW_CACHE_DIR": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
    ran = subprocess.run(_command(script, code), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, f"{code}\n--- stdout ---\n{ran.stdout[-4000:]}\n--- stderr ---\n{ran.stderr[-4000:]}"


def test_there_are_python_blocks_and_each_is_a_program():
    blocks = _blocks("python")
    assert len(blocks) >= 10
    for heading, code in blocks:
        assert re.search(r"^(import|from) ", code, re.MULTILINE), f"the block under {heading!r} imports nothing"


def test_a_class_it_shows_from_an_example_is_the_examples_own():
    shown = {}
    for _, code in _blocks("python"):
        shown.update({node.name: ast.get_source_segment(code, node) for node in ast.parse(code).body
                      if isinstance(node, ast.ClassDef)})
    compared = []
    for path in sorted(EXAMPLES.glob("*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and node.name in shown:
                assert shown[node.name] == ast.get_source_segment(source, node), \
                    f"README.md's {node.name} differs from the one in examples/{path.name}"
                compared.append(node.name)
    assert "KindPairing" in compared


def test_a_signature_it_shows_is_the_functions_own():
    shown = [code for _, code in _blocks("text") if re.match(r"(df|T)\.\w+\(", code)]
    assert shown, "README.md shows df.jit's signature in a ```text block"
    for code in shown:
        call, arguments = code.strip().split("(", 1)
        namespace, name = call.split(".")
        function = getattr({"df": df, "T": T}[namespace], name)
        exec(f"def written({arguments[:-1]}): pass", scope := {})
        described = lambda signature: [(p.name, p.kind, p.default) for p in signature.parameters.values()]
        assert described(inspect.signature(scope["written"])) == described(inspect.signature(function)), code
