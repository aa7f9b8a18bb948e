"""Hypothesis strategies for random programs: `recipes()` draws the DAGs that `programs.build` runs.

    from hypothesis import given
    from dynaflow_fn.testing import programs, strategies

    @given(recipe=strategies.recipes())
    def test_my_pass(recipe):
        inputs, fn = programs.build(recipe)
        ...

hypothesis is a test extra (`pip install hypothesis`, or `pip install "dynaflow-fn[test]"`); this
module raises a DynaflowError saying so when it is missing.
"""

from __future__ import annotations

from .programs import BINARY, UNARY, Recipe
from .requirements import require_hypothesis

st = require_hypothesis().strategies


@st.composite
def recipes(draw: st.DrawFn, max_inputs: int = 3, max_ops: int = 12, max_outputs: int = 3) -> Recipe:
    """A random DAG: 1 to `max_inputs` inputs, 2 to `max_ops` ops, each reading one or two earlier
    values (an elementwise op, or a matmul by the shared weight), and 1 to `max_outputs` returned values."""
    inputs = draw(st.integers(1, max_inputs))
    ops = []
    for i in range(draw(st.integers(2, max_ops))):
        available = inputs + i
        choice = draw(st.integers(0, 2))
        if choice == 0:
            ops.append((draw(st.sampled_from(sorted(UNARY))), draw(st.integers(0, available - 1)), None))
        elif choice == 1:
            ops.append(("matmul", draw(st.integers(0, available - 1)), None))
        else:
            ops.append((draw(st.sampled_from(sorted(BINARY))), draw(st.integers(0, available - 1)),
                        draw(st.integers(0, available - 1))))
    total = inputs + len(ops)
    outputs = sorted(set(draw(st.lists(st.integers(inputs, total - 1), min_size=1, max_size=max_outputs))))
    return inputs, tuple(ops), tuple(outputs)
