"""`df.region` under torch.compile: what it reads must not change when a df trace first runs."""

import threading

import torch

import dynaflow_fn as df


def test_a_first_trace_does_not_recompile_what_torch_compile_compiled_before_it():
    compiles = []

    def counting_backend(graph_module, example_inputs):
        compiles.append(graph_module)
        return graph_module.forward

    def f(x):
        with df.region("r"):
            return x + 1

    compiled = torch.compile(f, backend=counting_backend)
    seen = []

    def in_a_fresh_thread():                       # where no df trace has run yet
        compiled(torch.randn(3))
        seen.append(len(compiles))
        df.trace(lambda x: x * 2, torch.randn(3))
        compiled(torch.randn(3))
        seen.append(len(compiles))

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join()
    assert seen[0] >= 1 and seen[1] == seen[0]
