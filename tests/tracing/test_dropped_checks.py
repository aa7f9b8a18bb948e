"""tracing/dropped_checks.py: a run-time check that a plan does not run (a torch.linalg result's,
torch._assert_async) warns while tracing, instead of disappearing without a word."""

import warnings

import pytest
import torch

import dynaflow_fn as df


@pytest.mark.parametrize("fn, x, named", [
    (torch.linalg.inv, torch.zeros(2, 2), "LinAlgError"),
    (torch.linalg.cholesky, -torch.eye(2), "LinAlgError"),
    (lambda x: (torch._assert_async((x > 0).all()), x * 2)[1], -torch.ones(2), "torch._assert_async"),
], ids=["inv-singular", "cholesky-not-positive-definite", "assert-async"])
def test_a_check_the_plan_does_not_run_warns(fn, x, named):
    with pytest.raises(RuntimeError):
        fn(x)                                        # eager PyTorch refuses the input
    with pytest.warns(UserWarning, match=rf"runs .*{named}.*a plan does not run it"):
        df.jit(fn)(x)


def test_functions_without_checks_do_not_warn():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df.jit(lambda a: torch.linalg.inv_ex(a).inverse * 2)(torch.eye(2) * 3)
    assert [str(w.message) for w in caught] == []
