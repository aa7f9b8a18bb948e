"""Which `out=` kernels lowering may use: an op runs as a KERNEL step into planned memory only when its
out= overload exists, writes nothing but its result, and (checked on fake tensors) writes the
functional result's exact layout into the buffer it is given.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
from torch import fx

from ..errors import KERNEL_ERRORS
from ..ir import ops
from ..ir.tree import TensorSpec
from .draft import flat_values, map_nodes, storage_key


def allocates(node: fx.Node) -> bool:
    """Whether lowering would allocate the node's result (no direct out= kernel)."""
    variant = ops.out_variant(node.target)
    return variant is None or not variant.direct


class _VerdictCache:
    """Verdicts of the out= probe, one per call signature (op, argument and result layouts).

    The probe runs a kernel on fake tensors, and repeated layers call the same ops on the same shapes,
    so a deep model would run it thousands of times. The verdict depends only on the signature, so one
    cache serves every lowering in the process.
    """

    def __init__(self) -> None:
        self._verdicts: dict[Hashable, bool] = {}

    def get(self, key: Hashable, probe: Callable[[], bool]) -> bool:
        if key not in self._verdicts:
            self._verdicts[key] = probe()
        return self._verdicts[key]


_OUT_CALL_VERDICTS = _VerdictCache()


def out_call_is_faithful(node: fx.Node, variant: ops.OutVariant) -> bool:
    """Run the out= overload on fake tensors: it must write the functional result's exact layout into
    the buffer it is given."""
    values = flat_values(node)
    fake_mode = getattr(values[0], "fake_mode", None)
    if fake_mode is None:
        return False
    args = map_nodes(tuple(node.args), lambda n: n.meta["val"])
    kwargs = map_nodes(dict(node.kwargs), lambda n: n.meta["val"])
    probe = lambda: _run_out_call(fake_mode, variant, node.target, args, kwargs, values)
    try:
        key = (variant.op, _meta_signature((args, kwargs)), _meta_signature(values))
        hash(key)
    except TypeError:
        return probe()
    return _OUT_CALL_VERDICTS.get(key, probe)


def _meta_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (list, tuple)):
        return tuple(_meta_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _meta_signature(v)) for k, v in value.items())
    return value


def _run_out_call(fake_mode: Any, variant: ops.OutVariant, op: Any, args: tuple, kwargs: dict,
                  values: list[Any]) -> bool:
    pos, kw = variant.call_arguments(ops.bind_arguments(op, args, kwargs))
    try:
        with fake_mode:
            outs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in values]
            storages = [(storage_key(o), o.untyped_storage().nbytes()) for o in outs]
            result = variant.op(*pos, **kw, **dict(zip(variant.out_names, outs)))
    except KERNEL_ERRORS:          # the out= kernel refuses these arguments: the op allocates instead
        return False
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    # An out= kernel may resize `out` on the way (mse_loss.out computes the unreduced loss in it first).
    # In the arena that would write past the buffer, so the storage must keep its identity and size.
    return len(results) == len(outs) and all(
        r.shape == v.shape and r.stride() == v.stride() and (storage_key(r), r.untyped_storage().nbytes()) == before
        for r, v, before in zip(results, values, storages))
