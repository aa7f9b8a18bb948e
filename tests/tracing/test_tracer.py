"""Trace errors name the line of the traced function's own code: never a frame of the standard library, of
torch or of dynaflow_fn, nor the caller's line that started the trace."""

import contextlib
import os

import pytest
import torch
import transformers

import dynaflow_fn as df
from dynaflow_fn.errors import is_installed_package_file, is_library_file


def _multiplies_at_exit(a, b):
    with contextlib.ExitStack() as stack:
        stack.callback(torch.mm, a, b)               # torch.mm runs inside contextlib's __exit__
    return a


def test_a_torch_call_made_by_the_standard_library_names_the_users_line():
    with pytest.raises(df.TraceError) as caught:
        df.jit(_multiplies_at_exit)(torch.randn(4, 8), torch.randn(7, 3))
    message = str(caught.value)
    assert "contextlib.py" not in message and f"{os.path.basename(__file__)}:" in message
    assert "with contextlib.ExitStack() as stack" in message


def test_an_error_inside_torch_alone_names_no_line_of_the_caller():
    fn, params = df.pure(torch.nn.Linear(4, 4))
    del params["bias"]
    with pytest.raises(df.TraceError) as caught:
        df.jit(fn)(params, torch.randn(2, 4))        # functional_call misses a key, inside torch
    message = str(caught.value)
    assert message.startswith("Linear failed in the traced function") and "Missing key(s): 'bias'" in message
    assert "contextlib" not in message and "df.jit(fn)(params" not in message


def test_the_standard_library_is_library_code_and_installed_packages_are_model_code():
    assert is_library_file(contextlib.__file__) and is_library_file(os.__file__)
    assert is_library_file(torch.__file__) and is_library_file(df.__file__)
    assert not is_library_file(transformers.__file__) and is_installed_package_file(transformers.__file__)
    assert not is_library_file(__file__) and not is_installed_package_file(__file__)
