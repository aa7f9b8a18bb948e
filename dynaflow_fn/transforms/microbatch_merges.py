"""Why merging the micro-batches' outputs as `out_axes` says differs from the unsplit function.

`microbatch_body` studies the body once (`BodyFacts`: each output's row state, its reads of the
batch size, its terms that read no row); after the micro-batches ran, `merge_warnings` compares each
output's state with its merge: rows concatenated along another axis, a reduction concatenated, rows
averaged, a value kept from the first micro-batch though it reads the rows, a non-sum added up, an
average added up, a term counted once per micro-batch, a loss averaged over targets by rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .microbatch_body import BodyFacts
from .row_states import UNKNOWN, Reduced, Rows, State


def merge_warnings(facts: BodyFacts, merges: Sequence[tuple[str, Any, Any]], num: int) -> list[str]:
    """Why merging `num` micro-batches' outputs as `merges` says (per output: its path, its out_axes
    leaf and the first micro-batch's value) gives other values than the unsplit function, as warning
    texts."""
    texts, counted_again, sized, size_texts = [], [], [], {}
    for where, axis, value in merges:
        if isinstance(value, torch.Tensor) and where not in facts.shared and (
                text := _merge_warning(where, facts.rows.get(where), axis, value.dim(), where in facts.size_numbers)):
            texts.append(text)
        if axis == "sum" and where in facts.batch_free_terms:
            counted_again.append(f"{where} (at {facts.batch_free_terms[where]})")
        if axis != "mean" and where in facts.size_numbers and where not in facts.shared:
            sized.append(where)
            size_texts.update(dict.fromkeys(facts.size_numbers[where]))
    if sized:
        texts.append(f"microbatch: {'; '.join(size_texts)}. Each micro-batch reads its own size there, not the "
                     f"batch's, and {_listed(sized)} {'is' if len(sized) == 1 else 'are'} computed from it and merged "
                     f"otherwise than by out_axes \"mean\", so the micro-batched function returns the micro-batches' "
                     f"values, not the unsplit function's. Compute such values outside the micro-batched function and "
                     f"pass them in.")
    if counted_again:
        texts.append(f"microbatch: {_listed(counted_again)} {'adds' if len(counted_again) == 1 else 'add'} a term that "
                     f"reads no batch row to a sum over the rows (a penalty on the weights, its gradient, a constant), "
                     f"and out_axes \"sum\" adds the micro-batches' values, so that term is counted {num} times, once "
                     f"per micro-batch, where the unsplit function counts it once; an output that reads no batch row at "
                     f"all (the gradient of a weight only the penalty reads) comes back once. Add such terms outside "
                     f"the micro-batched function, or divide them by the number of micro-batches.")
    if facts.target_means and "mean" in [axis for _, axis, _ in merges]:
        texts.append(f"microbatch: the loss averages over its targets, not its rows ({', '.join(facts.target_means)}: "
                     f"cross-entropy's reduction='mean' divides by the targets other than ignore_index, weighted by "
                     f"class weight if given), and out_axes \"mean\" weights the micro-batches by rows. The two agree "
                     f"only where every micro-batch holds the same share of such targets; with targets labelled "
                     f"ignore_index (padding, prompt tokens: -100), the loss and gradients are not the batch's. Sum the "
                     f"loss instead (reduction='sum'), divide it by the whole batch's count of counted targets (an "
                     f"argument not split, as transformers' num_items_in_batch), and merge with out_axes \"sum\".")
    return texts


def _listed(items: Sequence[str], most: int = 3) -> str:
    """`a, b, c and 4 more`."""
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _merge_warning(where: str, state: State, axis: Any, rank: int, sized: bool) -> str | None:
    """Why merging an output of this state and rank with this `out_axes` leaf differs from the unsplit
    result. `sized`: the output reads the batch size as a number (a mean times the rows is a sum)."""
    if isinstance(axis, int) and rank:
        axis %= rank
    if axis is None and (isinstance(state, (Reduced, Rows)) or state is UNKNOWN):
        return (f"microbatch: {where} reads the batch rows, but out_axes None keeps the first micro-batch's value "
                f"of it, not the batch's. Give it the axis of its rows to concatenate it, or \"sum\" or \"mean\" "
                f"to reduce it across micro-batches.")
    if isinstance(state, Reduced) and axis in ("sum", "mean") and state.not_a_sum:
        how = (f"by {state.by}, which is not a sum or mean over them" if state.not_a_sum == state.by else
               f"by {state.by}, then passed through {state.not_a_sum}, which is not linear in that sum")
        return (f"microbatch: {where} is reduced over the batch rows {how}, so out_axes \"{axis}\", which "
                f"{'adds up' if axis == 'sum' else 'averages'} the micro-batches' values, does not give the batch's "
                f"value. Return the sums or means it is made of (merged by \"sum\" or \"mean\") and finish it "
                f"outside the micro-batched function.")
    if isinstance(state, Reduced) and axis == "sum" and state.mean and not sized:
        return (f"microbatch: {where} averages over the batch rows (by {state.by}), but out_axes \"sum\" adds up the "
                f"micro-batches' averages, which is not the batch's average. Give it out_axes \"mean\" (weighted by "
                f"rows), or sum it over the rows and divide by a count passed in unsplit.")
    if isinstance(state, Reduced) and axis == "mean" and not state.mean and not sized:
        return (f"microbatch: {where} adds up the batch rows (by {state.by}), but out_axes \"mean\" averages the "
                f"micro-batches' sums, which gives the batch's sum divided by the number of micro-batches. Give it "
                f"out_axes \"sum\", or average over the rows (.mean(), reduction=\"mean\") to merge it by \"mean\".")
    if isinstance(state, Reduced) and isinstance(axis, int):
        return (f"microbatch: {where} is reduced over the batch rows (by {state.by}), but out_axes "
                f"concatenates it along axis {axis}: that gives one reduction per micro-batch, not one over the "
                f"batch. Give it out_axes \"mean\" or \"sum\" (a loss: \"mean\") to reduce across micro-batches.")
    if not isinstance(state, Rows):
        return None
    if axis in ("sum", "mean"):
        return (f"microbatch: {where} has one row per batch row (along axis {state.axis}), but out_axes "
                f"\"{axis}\" adds the micro-batches' rows together. Give it out_axes={state.axis} to concatenate "
                f"them.")
    if isinstance(axis, int) and state.outer != 1:
        return (f"microbatch: {where} interleaves the batch rows with another dimension in axis {state.axis}, so "
                f"concatenating micro-batches along it puts rows out of order. Return it with the batch as its "
                f"own (or outermost) dimension.")
    if isinstance(axis, int) and axis != state.axis:
        return (f"microbatch: {where} has the batch rows along axis {state.axis}, but out_axes concatenates it "
                f"along axis {axis}. Give it out_axes={state.axis}.")
    return None
