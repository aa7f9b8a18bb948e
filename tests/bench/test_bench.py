"""`python -m bench` on a machine without CUDA: it runs what needs no GPU, writes nothing, exits 0."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.fixture
def no_gpu(monkeypatch, tmp_path):
    """A machine without CUDA whose results folder is a fresh temporary one."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import common

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    return tmp_path


def test_bench_without_a_gpu_runs_only_the_trace_timing_and_says_what_it_skipped(no_gpu, monkeypatch, capsys):
    from bench import __main__ as bench_main
    from bench import report

    commands = []
    monkeypatch.setattr(bench_main.subprocess, "run", lambda command, check: commands.append(command))
    monkeypatch.setattr(report, "main", lambda: pytest.fail("the report was rebuilt without a GPU"))
    monkeypatch.setattr(sys, "argv", ["bench"])
    bench_main.main()                                   # returns: exit status 0
    assert commands == [[sys.executable, "-m", "bench.overhead", "--trace"]]
    printed = capsys.readouterr().out
    for module in bench_main.SINGLE_GPU[1:] + bench_main.MULTI_GPU:
        assert module in printed
    assert "Nothing is written to bench/results/" in printed


def test_trace_timing_without_a_gpu_is_printed_not_written(no_gpu, monkeypatch, capsys):
    from bench import overhead

    row = {"case": "a model", "variant": "df.trace+lower", "trace_s": 1.0, "lower_s": 0.5, "total_s": 1.5,
           "ops": 10, "steps": 9}
    monkeypatch.setattr(overhead, "trace_and_lower_seconds", lambda: row)
    monkeypatch.setattr(sys, "argv", ["overhead", "--trace"])
    overhead.main()
    assert "not written to bench/results/" in capsys.readouterr().out
    assert os.listdir(no_gpu) == []


def test_results_are_never_written_without_a_gpu(no_gpu):
    from bench import common

    with pytest.raises(RuntimeError, match="without a CUDA device"):
        common.write_results("overhead", [{"case": "c", "variant": "v", "median_ms": 1.0}])
    assert os.listdir(no_gpu) == []


@pytest.mark.slow
def test_python_m_bench_exits_0_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "df.trace+lower" in result.stdout and "not written to bench/results/" in result.stdout


def test_a_jitted_peer_reports_the_strategy_auto_kept(monkeypatch, tmp_path):
    """bench rows name what `strategy="auto"` chose (its "choice" column), read from the df.jit object
    behind the call; a call with a fixed strategy has no choice."""
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.setenv("DYNAFLOW_CACHE_DIR", str(tmp_path))          # measured, not recalled
    from bench.common import chosen_strategies, jitted

    def fn(x, y):
        return torch.relu(x @ y).sum(-1)

    args = (torch.randn(16, 16), torch.randn(16, 16))
    auto = jitted(fn, args, strategy="auto", progress=False)
    [choice] = auto.jitted.choices.values()
    assert chosen_strategies(auto) == choice.strategy
    assert chosen_strategies(jitted(fn, args)) is None
