"""Tools to prove your own strategy (a partition rule, a Scheduler, a Program -> Program transform)
correct in your unit tests.

    from dynaflow_fn import testing as dft

    dft.assert_equivalent(model_fn, T.overlap(T.microbatch(model_fn, num=2, in_axes=(None, 0)), MyScheduler()),
                          params, x)                  # fresh inputs, uneven splits: exact and within tolerance
    dft.check_scheduler(MyScheduler, max_examples=25)  # random programs: valid, verified, exact, deterministic
    dft.check_substitution(fn, {T.Region("attn"): my_attention}, params, x, in_axes=(None, 0))

Writing a transform: subclass `T.Pass` with `apply(program) -> Program`, returning a new Program
(`program.annotate(update)` or `program.with_graph(graph_module)`; never mutate the input) stamped
by `T.record(program, new, self)`, and `describe()`, the line `print(program)` lists under "passes"
(a pass that finds nothing to change returns `T.record(program, program, self)`, and adds no line).
`T.apply_transform(fn, MyPass())` attaches it to a function
(a `T.Transformed`), to a Program, or, with fn None, returns it as a one-argument transform for
`T.compose`. A pass whose Program computes values the function's code does not (a substitution) sets
`changes_values = True`. A traced transformed function applies the passes in order; called eagerly it
runs the original function, micro-batch after micro-batch (or, with a pass that changes values, its
traced Program), which is the reference `assert_equivalent`
compares the jitted result with bit for bit. `examples/custom_transform.py` is a complete one.

Modules: `inputs` (fresh inputs, batch axes, edge batch sizes), `compare` (where two results first
differ), `programs` (random DAGs, `EachNode`, `RandomScheduler`), `strategies` (hypothesis
strategies) and `pytest_plugin` (`pytest_plugins = ["dynaflow_fn.testing.pytest_plugin"]`: seeded
fresh inputs per test and a `cuda` marker). Only `strategies` and `check_scheduler` need hypothesis.
"""

from .compare import first_difference
from .equivalence import assert_equivalent
from .inputs import batch_axes, draw_like, edge_batch_sizes
from .programs import EachNode, RandomScheduler, build
from .schedulers import check_scheduler
from .substitution import check_substitution

__all__ = ["EachNode", "RandomScheduler", "assert_equivalent", "batch_axes", "build", "check_scheduler",
           "check_substitution", "draw_like", "edge_batch_sizes", "first_difference"]
