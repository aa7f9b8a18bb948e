"""A custom overlap policy in 30 lines: pair compute-bound with memory-bound stages.

A Scheduler sees the stage DAG (micro-batch, kind, tags, cost of every stage) and picks, among the
ready stages, what to issue next and on which stream. This one keeps each micro-batch on its own
stream and, whenever it can, issues a stage whose kind differs from the one just issued, so a GEMM
of one micro-batch runs beside the attention or normalization of the other.

    python examples/custom_scheduler.py
"""

import torch

import dynaflow_fn as df
from dynaflow_fn import transforms as T


class KindPairing(df.Scheduler):
    """Alternate micro-batches and resource kinds; micro-batch i runs on stream i."""

    def streams(self, graph):
        return [df.Stream(i, f"mb{i}") for i in range(max(1, len(graph.micro_batches)))]

    def pick(self, ready, graph, issued):
        last = graph.stages[issued[-1].stage] if issued else None
        stage = min(ready, key=lambda s: (last is not None and s.mb == last.mb,
                                          last is not None and s.kind == last.kind, s.index))
        return stage, graph.micro_batches.index(stage.mb) if stage.mb is not None else 0


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 64))
    fn, params = df.pure(model)
    step = T.microbatch(fn, num=2, in_axes=(None, 0))
    step = T.partition(step, rules=[T.Module(torch.nn.Linear)])
    step = T.overlap(step, strategy=KindPairing())
    x = torch.randn(32, 64)
    fast = df.jit(step)
    torch.testing.assert_close(fast(params, x), model(x))
    plan = fast.lower(params, x)
    print(plan)
    df.verify(plan)
    print("\nverified: every cross-stream access is ordered by an event")


if __name__ == "__main__":
    main()
