"""examples/quickstart.py: what a new user sees first shows ops, steps, the same result, and why the CPU is no faster."""

import re

import pytest
import torch

from example_loader import load_example



@pytest.mark.slow
def test_quickstart_prints_ops_and_steps_and_matches_eager(capsys):
    load_example("quickstart").main()
    printed = capsys.readouterr().out
    program, plan = printed.split("# Plan ", 1)
    assert re.search(r"^    \w+: \S.* = aten\.\w+", program, re.MULTILINE), program      # an op of the program
    assert re.search(r"^steps:\n    s0 \w+", plan, re.MULTILINE), plan                  # a step of the plan
    difference = float(re.search(r"max \|eager - df\.jit\| = (\S+)", printed)[1])
    assert difference < 1e-5
    if not torch.cuda.is_available():
        assert "no speed-up is\nexpected" in printed
