"""Copying a call's copied-in inputs into the static buffers its CUDA graph reads.

One `copy_` per input costs a dispatcher call and a launch (7 to 14 us of host time each on an H200's
host), and a transformers decoding step copies in three inputs (token ids, positions, mask), its
prefill ten. So the inputs of one dtype on the graph's device are copied by one
`torch._foreach_copy_` (`compat.foreach_copy`): one call, and one kernel where every layout is dense
(otherwise torch copies them one by one, as `copy_` would). An input of another device (a CPU tensor
copied into a CUDA graph) or of a dtype no other input shares is copied by its own `copy_`. A source
that requires grad is detached first: the copy belongs to no autograd graph.
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
        groups: dict[torch.dtype, list[int]] = {}
        for i in copied:
            key = examples[i].dtype if examples[i].device == device else None
            groups.setdefault(key, []).append(i)
        batched = [indices for key, indices in groups.items() if key is not None and len(indices) > 1]
        self.alone = [(i, buffers[i]) for indices in groups.values() if indices not in batched for i in indices]
        self.batched = [(indices, [buffers[i] for i in indices]) for indices in batched]

    def __call__(self, inputs: Sequence[torch.Tensor]) -> None:
        for i, buffer in self.alone:
            source = inputs[i]
            if source is not buffer:
                buffer.copy_(source.detach() if source.requires_grad else source)
        for indices, buffers in self.batched:
            sources = [inputs[i] for i in indices]
            compat.foreach_copy(buffers, [source.detach() if source.requires_grad else source for source in sources])
