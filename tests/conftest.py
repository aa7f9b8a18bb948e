"""The repository's tests use the plugin users get: seeded fresh inputs per test, the `cuda` marker."""

pytest_plugins = ["dynaflow_fn.testing.pytest_plugin"]
