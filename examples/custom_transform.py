"""A Program -> Program transform of your own: memory-bound work of one micro-batch on a side stream.

Under round-robin overlap, micro-batch i runs on stream i. This transform (a `T.Pass`) takes the
memory-bound stages (norms, activations, elementwise ops: what the cost model calls "memory") of
one micro-batch off its stream onto a stream of their own, so they can run beside that
micro-batch's next GEMM instead of in front of it. It only re-places nodes; lowering adds the
events that keep every read after its write, and `df.verify` proves it.

    python examples/custom_transform.py
"""

import torch

import dynaflow_fn as df
from dynaflow_fn import testing as dft
from dynaflow_fn import transforms as T
from dynaflow_fn.errors import TransformError
from dynaflow_fn.transforms.base import apply_transform, record


class MemoryStagesAside(T.Pass):
    """Put every memory-bound stage of micro-batch `mb` on a new side stream. Apply after T.overlap."""

    def __init__(self, mb: int = 1):
        self.mb = mb

    def describe(self) -> str:
        return f"memory_stages_aside(mb={self.mb})"

    def apply(self, program: df.Program) -> df.Program:
        if not program.is_scheduled():
            raise TransformError("memory_stages_aside re-places scheduled nodes: apply it after T.overlap")
        side = df.Stream(len(program.streams), f"mb{self.mb}-memory")
        aside = {stage.index for stage in T.StageGraph.from_program(program).stages
                 if stage.mb == self.mb and stage.kind == "memory"}
        new = program.annotate(lambda node, node_info: node_info.replace(stream=side.index)
                               if node_info.stage in aside else node_info,
                               streams=(*program.streams, side))
        return record(program, new, self)


def memory_stages_aside(fn=None, mb: int = 1):
    """The transform as users call the built-ins: on a function, a Program, or (fn None) later."""
    return apply_transform(fn, MemoryStagesAside(mb))


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.LayerNorm(1024),
                                torch.nn.Linear(1024, 256))
    fn, params = df.pure(model)
    step = T.microbatch(fn, num=2, in_axes=(None, 0))
    step = T.partition(step, rules=[T.Module(torch.nn.Linear), T.Module(torch.nn.LayerNorm)])   # GELUs: between
    step = memory_stages_aside(T.overlap(step, strategy="roundrobin"), mb=1)
    x = torch.randn(512, 256)
    print(df.trace(step, params, x))
    plan = df.verify(df.jit(step).lower(params, x))
    print(f"\n{len(plan.streams)} streams, verified: every cross-stream access is ordered by an event")
    dft.assert_equivalent(fn, step, params, x)
    print("equal to eager: bit for bit to the micro-batched function, within tolerance to the model")


if __name__ == "__main__":
    main()
