"""`df.jit(fn, buckets=...)`'s calls: each padded to its bucket and run by that bucket's plan, the
plans of one argument structure sharing one `SharedPool`, the largest built first.

A call finds its bucket by one list index (`buckets.BucketTable`), pads its batched leaves to it (not
at a bucket's own size), runs the plan of that bucket (each bucket is a signature of its own, so the
per-call check, the cache and `strategy="auto"` work per bucket as for any signature) and cuts the
outputs back. Each bucket keeps the plan it ran last, so a loop whose batch moves between buckets
passes every call through the cheap check of that bucket's plan, not the full lookup.

Memory, decided here: on the first call of a new argument structure, whatever its batch size, the
plan of the largest bucket is built first (traced, lowered and captured, not run), so that the
buffers every bucket shares (arena, outputs, static inputs, the graph pool: `runtime.shared_pool`)
are allocated at their largest size; only building that plan tells its sizes. Other buckets are
built on demand, on their first call, in that memory. vLLM captures every size at start-up; on
demand, only the sizes the workload reaches cost a capture. A batch past the largest bucket runs a
plan of its own exact size and memory, after a warning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import optree
import torch

from ..errors import TraceError, UnpaddableError, warn
from ..ir.signature import device_of
from ..ir.tree import Flat
from ..runtime.shared_pool import SharedPool
from ..tracing.tracer import trace_flat
from ..transforms.microbatch_body import study_trace
from .buckets import BatchLayout, BucketTable, OutputAxes
from .call import CallSignature
from .guard import call_state
from .padding_check import padding_warnings

if TYPE_CHECKING:
    from .jitted import Jitted
    from .replayer import Replayer


class Bucketing:
    """The bucket side of one jitted function (see the module docstring)."""

    def __init__(self, jitted: "Jitted"):
        self.jitted = jitted
        self.table = BucketTable(jitted.options.buckets)
        self.outputs = OutputAxes(jitted.options.out_axes)
        self.real_rows = self.padded_rows = 0
        self._layout: tuple[Any, BatchLayout] | None = None
        self._layouts: dict[Any, BatchLayout] = {}
        self._last: dict[int, Replayer] = {}
        self._pools: dict[CallSignature, SharedPool] = {}
        self._checked = self._warned_beyond = False

    def call(self, leaves: list[Any], treedef: Any) -> Any:
        """One call: pad, run the bucket's plan, cut the outputs back."""
        layout = self.layout(leaves, treedef)
        rows = layout.rows(leaves)
        table = self.table.table
        bucket = table[rows] if rows < len(table) else self._beyond(rows)
        padded = leaves if rows == bucket else layout.pad(leaves, rows, bucket)
        try:
            outputs, replayer = self.jitted._run(padded, treedef, self._last.get(bucket))
        except TraceError as error:
            largest = self.table.largest
            if rows >= largest:                       # traced as called: nothing was padded
                raise
            at = f"{bucket} rows" if bucket == largest else f"{bucket} rows (and first at the largest bucket's {largest})"
            raise TraceError(
                f"df.jit({self.jitted.name}) with buckets traces each call padded to a bucket: this one, of {rows} "
                f"rows, at {at}. {error} A function that reads "
                f"the batch size other than through the rows in_axes names (a tensor sliced by it, images[:batch]) "
                f"sees other shapes once padded: give such tensors an axis in in_axes too, or call it without "
                f"buckets.") from error
        if replayer is not None:
            self._last[bucket] = replayer
        self.real_rows += rows
        self.padded_rows += bucket - rows
        return outputs if rows == bucket else self.outputs.unpad(outputs, rows, bucket)

    def padded(self, flat: Flat) -> Flat:
        """The call `flat` as its bucket's plan takes it (for `fast.trace` and `fast.lower`)."""
        layout = self.layout(flat.leaves, flat.treedef)
        rows = layout.rows(flat.leaves)
        bucket = self.table.bucket(rows)
        return flat if rows == bucket else _padded_flat(layout, flat, rows, bucket)

    def compiling(self, flat: Flat) -> tuple[SharedPool | None, str]:
        """For a call (padded to its bucket) about to be planned: the memory its plan shares with the
        other buckets of its structure, and the name its cold start shows. The first plan of a
        structure makes that memory, building the largest bucket's plan first."""
        layout = self.layout(flat.leaves, flat.treedef)
        rows = layout.rows(flat.leaves)
        label = f"{self.jitted.name}, batch {rows}"
        largest = self.table.largest
        if rows > largest:
            self._check_rows(layout, flat)
            return None, label
        at_largest = flat if rows == largest else _padded_flat(layout, flat, rows, largest)
        family = CallSignature.of(at_largest, call_state())
        if family is None:                       # an unhashable leaf: tracing will name it
            return None, label
        memory = self._pools.get(family)
        if memory is None:
            self._check_rows(layout, at_largest)
            tensors = [leaf for leaf in at_largest.leaves if isinstance(leaf, torch.Tensor)]
            memory = self._pools[family] = SharedPool(device_of(tensors))
            if rows != largest:
                replayer, _ = self.jitted._entry(at_largest.leaves, at_largest.treedef, call_state(),
                                                (at_largest.args, at_largest.kwargs))
                replayer.prepare(at_largest.leaves)
        return memory, label

    def layout(self, leaves: Sequence[Any], treedef: Any) -> BatchLayout:
        """The batch layout of calls of this structure (computed on its first call)."""
        last = self._layout
        if last is not None and last[0] == treedef:
            return last[1]
        layout = self._layouts.get(treedef)
        if layout is None:
            options = self.jitted.options
            args, kwargs = optree.tree_unflatten(treedef, list(leaves))
            layout = BatchLayout.of(self.jitted.fn, options.in_axes, options.pad_value, args, kwargs, leaves,
                                    treedef.paths(), (*options.donate_argnums, *options.persistent_argnums))
            self._layouts[treedef] = layout
        self._layout = (treedef, layout)
        return layout

    def clear(self) -> None:
        self._last.clear()
        self._pools.clear()

    def _beyond(self, rows: int) -> int:
        """A batch past the largest bucket: planned at its own size, with a warning the first time."""
        if not self._warned_beyond:
            self._warned_beyond = True
            warn(f"df.jit({self.jitted.name}) got a batch of {rows} rows, more than its largest bucket "
                 f"({self.table.largest}): it runs a plan of exactly {rows} rows, traced and captured for that "
                 f"size with memory of its own, as does every other size past {self.table.largest}. Add larger "
                 f"buckets, or split the batch.")
        return rows

    def _check_rows(self, layout: BatchLayout, flat: Flat) -> None:
        """Warn, once per function, where padding may change the real rows' results (`padding_check`)."""
        if self._checked:
            return
        rows = layout.rows(flat.leaves)
        with study_trace() as study:          # T.microbatch inside: its body on the whole batch
            program = trace_flat(self.jitted.fn, flat)
            texts = padding_warnings(program, layout, flat.leaves, self.outputs, not self.jitted.options.pads_with_zeros,
                                     lambda more: trace_flat(self.jitted.fn, _padded_flat(layout, flat, rows, more)),
                                     study.microbatched)
        if texts and self.jitted.options.refuse_inexact_padding:
            reason = "; ".join(texts)
            raise UnpaddableError(f"df.jit({self.jitted.name}) with buckets: {reason}", reason)
        self._checked = True                      # only once it passed: a refused call is refused again
        for text in texts:
            warn(f"df.jit({self.jitted.name}) with buckets: {text}")


def _padded_flat(layout: BatchLayout, flat: Flat, rows: int, bucket: int) -> Flat:
    leaves = layout.pad(flat.leaves, rows, bucket)
    args, kwargs = optree.tree_unflatten(flat.treedef, leaves)
    return Flat(args, kwargs, leaves, flat.treedef)
