"""The repository's tests use the plugin users get: seeded fresh inputs per test, the `cuda` marker.
Fixtures that tests of several folders share live here."""

import pytest
import torch

from fixtures import native_checks_ready

pytest_plugins = ["dynaflow_fn.testing.pytest_plugin"]


@pytest.fixture(scope="session", autouse=True)
def _native_checks_ready():
    native_checks_ready()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches are global and cap recompiles per code object: start and leave them empty, so
    a test sees no graph of another and leaves none behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
