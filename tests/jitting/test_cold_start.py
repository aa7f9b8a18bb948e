"""The first call's progress bar: silent when quick, naming each phase and its seconds when slow."""

import io
import sys

from dynaflow_fn.jitting import pipeline
from dynaflow_fn.jitting.pipeline import ColdStart


def _first_call(name: str) -> ColdStart:
    timed = ColdStart(name, show=True)
    for phase in ("trace", "inductor", "lower", "capture"):
        with timed.phase(phase):
            pass
    timed.finish()
    return timed


def test_a_quick_first_call_prints_nothing(capsys):
    assert list(_first_call("quick").seconds) == ["trace", "inductor", "lower", "capture"]
    assert capsys.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_slow_first_call_names_its_phases_on_a_terminal_and_their_seconds(monkeypatch):
    monkeypatch.setattr(pipeline, "SHOW_AFTER_S", 0.0)
    monkeypatch.setattr(sys, "stderr", terminal := _Terminal())
    _first_call("slow")
    shown = terminal.getvalue()
    assert "df.jit(slow), trace 0.0s, inductor 0.0s, lower 0.0s, capture 0.0s" in shown
    assert "capture..." in shown                                         # named while it ran


def test_a_slow_first_call_leaves_one_line_in_a_log(monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "SHOW_AFTER_S", 0.0)
    _first_call("slow")
    shown = capsys.readouterr().err
    assert shown.replace("\r", "") == "df.jit(slow), trace 0.0s, inductor 0.0s, lower 0.0s, capture 0.0s\n"
