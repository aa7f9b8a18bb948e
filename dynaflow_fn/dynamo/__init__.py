"""`df.compile_backend`: dynaflow_fn behind `torch.compile`, for unmodified modules.

TorchDynamo reads the model's Python, keeps its control flow on non-tensor values as guards and
hands each straight-line graph it captures to a backend, with graph breaks where it cannot follow.
This backend gives every captured graph to `df.jit`: the graph is traced to aten, transformed,
lowered to a static plan and replayed (one CUDA graph on CUDA), exactly as a function written for
dynaflow_fn would be. Graphs with symbolic sizes are planned per concrete signature
(`specializing`); graphs that need gradients go through AOTAutograd, whose forward and backward
graphs are planned each (`training`, with `views`).

    model = torch.compile(model, backend=df.compile_backend())
    logits = model(input_ids)                  # any sequence length
    loss_fn(logits, labels).backward()         # training, through AOTAutograd
"""

from .backend import CompileBackend, compile_backend

__all__ = ["CompileBackend", "compile_backend"]
