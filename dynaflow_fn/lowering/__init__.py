"""Lowering: a Program becomes a static Plan (`df.lower`).

For one input signature it decides how every node runs and where every tensor lives. `lower` runs
these sub-passes, in order, over one PlanDraft (each declares the draft fields it reads and writes,
`sub_pass.py`), and the Plan's provenance names those that changed something:

1. bind          (bind.py)           slots and storages for inputs and constants;
2. issue order   (issue_order.py)    the schedule's order of nodes, checked;
3. reinplace     (reinplace.py)      functional updates that may run inplace, writing their first argument;
4. emit steps    (emit_steps.py)     a step per node: view, out= kernel, allocating op, copy, setup;
5. outputs       (outputs.py)        donated outputs into their inputs, other outputs into lasting memory;
6. elide copies  (elide_copies.py)   a `cat` of whole kernel results: each part written into its slice;
7. synchronize   (synchronize.py)    fork/join, dependencies, pacing, and the fewest events;
8. sm budget     (sm_budget.py)      kernels beside a collective leave SMs to it;
9. place buffers (memory.py)         arena offsets under the final steps' happens-before order.

`donate_check.py` checks the `donate` pairs before any of them runs.
"""

from .lower import lower

__all__ = ["lower"]
