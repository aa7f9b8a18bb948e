"""Load a script of examples/ as a module, so tests call its functions instead of running a subprocess."""

import importlib.util
import os
from types import ModuleType

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def load_example(name: str) -> ModuleType:
    """examples/<name>.py, imported (its `if __name__ == "__main__"` part does not run)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example
