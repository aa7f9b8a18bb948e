"""Every built-in strategy, on both kinds of kernels, on real transformers models.

The factors are the strategy (roundrobin, tbo, branches and the custom scheduler of
examples/custom_scheduler.py), the partition (by op, module, region, cost kind, or none), the number
of micro-batches (2 or 3, on a batch that splits unevenly), the kernels (Inductor's or eager's) and
the model family. The full product is over a thousand compilations; the rows below are a pairwise
covering of it: every pair of values of any two factors is tested together at least once, so a bug
that needs two choices to meet is found, in 35 rows.

Each row checks that the plan runs on several streams and passes `df.verify`, that its result equals
eager PyTorch on fresh inputs within the dtype's tolerance, and on eager kernels that it equals the
sequential micro-batched program bit for bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.testing import first_difference
from example_loader import load_example
from models import CAUSAL_LMS, causal_lm_inputs, tag_attention_regions, tiny_causal_lm

KindPairing = load_example("custom_scheduler").KindPairing

STRATEGIES = {"roundrobin": "roundrobin", "tbo": "tbo", "branches": "branches", "custom": KindPairing}
PARTITIONS = {
    "op": T.Op(r"mm|bmm|addmm|linear"),
    "module": T.Module(r"attn$"),
    "region": T.Region("attn"),
    "kind": T.Kind("memory"),             # at these sizes the cost model finds every GEMM bandwidth-bound
    "none": None,
}


def pairwise(factors: dict[str, tuple]) -> list[dict[str, object]]:
    """A small set of rows in which every pair of values of two factors appears together: greedily,
    each row starts from a pair not yet covered and fills the other factors with the values that
    cover the most new pairs (on a tie, the value used least so far)."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b]}
    uses = {(name, value): 0 for name in names for value in factors[name]}
    rows = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=lambda pair: (names.index(pair[0][0]), names.index(pair[1][0]),
                                                           pair[0][1], pair[1][1]))
        row = {a: x, b: y}
        for name in names:
            if name not in row:
                row[name] = max(factors[name], key=lambda value: (sum(
                    ((n, row[n]), (name, value)) in uncovered or ((name, value), (n, row[n])) in uncovered
                    for n in row), -uses[(name, value)]))
        uncovered -= {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}
        for name in names:
            uses[(name, row[name])] += 1
        rows.append(row)
    return rows


ROWS = pairwise({"model": CAUSAL_LMS, "partition": tuple(PARTITIONS), "strategy": tuple(STRATEGIES),
                 "kernels": ("inductor", "eager"), "micro_batches": (2, 3)})


def test_the_rows_cover_every_pair_of_choices():
    for a, b in itertools.combinations(ROWS[0], 2):
        assert {(row[a], row[b]) for row in ROWS} == set(itertools.product({r[a] for r in ROWS}, {r[b] for r in ROWS}))
    assert len(ROWS) <= 40


@pytest.mark.slow
@pytest.mark.filterwarnings("error:partition rule")              # a rule that matches nothing tests nothing
@pytest.mark.filterwarnings("error:microbatch")                  # these models split exactly: a warning is wrong
@pytest.mark.parametrize("row", ROWS, ids=lambda row: "-".join(str(v) for v in row.values()))
def test_strategy_on_a_real_model(row):
    torch.manual_seed(0)
    model = tiny_causal_lm(row["model"])
    tag_attention_regions(model)
    fn, params = df.pure(model)

    def logits(params, input_ids, attention_mask):
        return fn(params, input_ids, attention_mask=attention_mask, use_cache=False).logits

    step = T.microbatch(logits, num=row["micro_batches"], in_axes=(None, 0, 0))
    rule = PARTITIONS[row["partition"]]
    if rule is not None:
        step = T.partition(step, rules=[rule])
    step = T.overlap(step, strategy=STRATEGIES[row["strategy"]])
    fast = df.jit(step, backend=row["kernels"], progress=False)

    batch = row["micro_batches"] + 1                              # an uneven split
    fast(params, *causal_lm_inputs(row["model"], batch))          # plans with the example inputs
    ids, mask = causal_lm_inputs(row["model"], batch, generator=torch.Generator().manual_seed(1))
    got = fast(params, ids, mask)
    assert fast.cache_info().misses == 1

    plan = fast.lower(params, ids, mask)
    assert len(plan.streams) > 1, plan
    df.verify(plan)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        sequential = step(params, ids, mask)
    assert first_difference(got, expected, exact=False) is None, first_difference(got, expected, exact=False)
    if row["kernels"] == "eager":
        assert first_difference(got, sequential, exact=True) is None, first_difference(got, sequential, exact=True)
