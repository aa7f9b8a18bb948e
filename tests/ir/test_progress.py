"""Progress bars: live and throttled on a terminal, a line or nothing in a log, however long they run."""

import contextlib
import io

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn.ir.progress import MININTERVAL_S, progress_bar
from dynaflow_fn.jitting import pipeline


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_that_stays_writes_one_line_to_a_log_however_many_steps():
    log = io.StringIO()
    bar = progress_bar(range(1000), desc="train", file=log)
    for step in bar:
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}")          # a forced redraw every step
    assert log.getvalue().count("\n") == 1 and log.getvalue().count("\r") == 1, repr(log.getvalue())
    assert "train: 100%" in log.getvalue() and "1000/1000" in log.getvalue() and "loss=0.001" in log.getvalue()


def test_a_transient_bar_writes_nothing_to_a_log():
    log = io.StringIO()
    for _ in progress_bar(range(1000), desc="inductor: compiling stages", leave=False, file=log):
        pass
    assert log.getvalue() == ""


def test_a_bar_shown_only_after_a_delay_stays_silent_in_a_log_when_it_ends_sooner():
    log = io.StringIO()
    bar = progress_bar(total=3, desc="df.jit(f)", delay=60, leave=True, file=log)
    bar.update(3)
    bar.close()
    assert log.getvalue() == ""


def test_on_a_terminal_a_bar_redraws_at_most_every_mininterval():
    terminal = Terminal()
    bar = progress_bar(range(100_000), desc="train", file=terminal)
    for _ in bar:
        pass
    redraws = terminal.getvalue().count("\r")
    assert 2 <= redraws <= 3 + bar.format_dict["elapsed"] / MININTERVAL_S, repr(terminal.getvalue())


def test_a_jitted_train_step_run_many_times_writes_two_lines_to_a_log(monkeypatch):
    monkeypatch.setattr(pipeline, "SHOW_AFTER_S", 0.0)       # the first call's bar is shown too
    forward, params = df.pure(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)))
    params = {name: p.detach() for name, p in params.items()}
    optimizer = df.optim.adamw(lr=1e-2)

    @df.jit(donate_argnums=(0, 1))
    def train_step(params, state, x, y):
        loss, grads = df.value_and_grad(lambda p: F.mse_loss(forward(p, x), y))(params)
        params, state = optimizer.update(grads, state, params)
        return params, state, loss

    state, x, y = optimizer.init(params), torch.randn(32, 8), torch.randn(32, 1)
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        bar = progress_bar(range(300), desc="train")
        for _ in bar:
            params, state, loss = train_step(params, state, x, y)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    lines = log.getvalue().replace("\r", "").splitlines()
    assert len(lines) == 2 and log.getvalue().count("\r") == 2, repr(log.getvalue())
    assert lines[0].startswith("df.jit(train_step), trace") and "300/300" in lines[1], lines
    assert train_step.cache_info().misses == 1
