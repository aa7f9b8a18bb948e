"""Copying a call's copied-in inputs into the static buffers its CUDA graph reads.

One `copy_` per input costs a dispatcher call and a launch (7 to 14 us of host time each on an H200's
host), and a transformers decoding step copies in three inputs (token ids, positions, mask), its
prefill ten. So the inputs of one dtype on the graph's device are copied by one
`torch._foreach_copy_` (`compat.foreach_copy`): one call, and one kernel where every layout is dense
(otherwise torch copies them one by one, as `copy_` would). On an H200's host, in one process: the
decode step's three inputs 19.0 us by copy_, 16.0 grouped; the prefill's ten 63.2 us and 9.8; a lone
input 7.4 us and 5.7 (a foreach of one is cheaper than `copy_`). An input of another device (a CPU
tensor copied into a CUDA graph) is copied by its own `copy_`. A source that requires grad is
detached first: the copy belongs to no autograd graph.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import compat


class CopyIn:
    """The copies of one executable's copied-in inputs (`copied`: their indices) into `buffers`, grouped
    by the dtype of the `examples` (the inputs it was built for) that are on `device`."""

    def __init__(self, buffers: Sequence[torch.Tensor | None], copied: Sequence[int],
                 examples: Sequence[torch.Tensor], device: torch.device):
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in copied:
            if examples[i].device == device:
                by_dtype.setdefault(examples[i].dtype, []).append(i)
        self.batched = [(indices, [buffers[i] for i in indices]) for indices in by_dtype.values()]
        self.alone = [(i, buffers[i]) for i in copied if examples[i].device != device]

    def __call__(self, inputs: Sequence[torch.Tensor]) -> None:
        for i, buffer in self.alone:
            source = inputs[i]
            if source is not buffer:
                buffer.copy_(source.detach() if source.requires_grad else source)
        for indices, buffers in self.batched:
            sources = [inputs[i] for i in indices]
            compat.foreach_copy(buffers, [source.detach() if source.requires_grad else source for source in sources])
