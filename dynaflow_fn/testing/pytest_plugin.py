"""A pytest plugin for tests of dynaflow_fn strategies. Enable it in a conftest.py or a test module:

    pytest_plugins = ["dynaflow_fn.testing.pytest_plugin"]

It gives every test fresh random inputs that are reproducible: before each test, torch's global
generator is seeded from the test's id (the `seed` fixture returns that seed, to pass on to
`assert_equivalent(seed=...)` or your own `torch.Generator`). Renaming a test changes its inputs;
rerunning it does not. For GPU tests it registers the `cuda` marker (`@pytest.mark.cuda` tests are
skipped, with a reason, where no CUDA device is available) and the `cuda_device` fixture, which
does the same for the test that asks for it and gives it the device. It also turns on strict mode
(DYNAFLOW_STRICT=1, unless set otherwise): a `strategy="auto"` candidate that breaks one of
dynaflow_fn's invariants raises instead of being skipped.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from ..errors import STRICT_ENV


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped where there is none)")
    os.environ.setdefault(STRICT_ENV, "1")       # a broken invariant fails the test instead of being skipped


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def seed_of(nodeid: str) -> int:
    """The seed of the test with this id: the same on every run and machine."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def seed(request: pytest.FixtureRequest) -> int:
    """Seeds torch's global generator from the test's id before every test, and returns the seed."""
    value = seed_of(request.node.nodeid)
    torch.manual_seed(value)
    return value


@pytest.fixture
def cuda_device() -> torch.device:
    """The CUDA device; the test asking for it is skipped where there is none."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")
