"""lowering/sub_pass.py and the driver: every sub-pass declares the draft fields it reads and writes,
the declarations are what the code does, an order that reads a field before it is written is
refused, and a draft printed between sub-passes shows the slots and steps decided so far."""

import dataclasses
import importlib

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.errors import InternalError
from dynaflow_fn.lowering.donate_check import checked_donation
from dynaflow_fn.lowering.draft import PlanDraft
from dynaflow_fn.lowering.sub_pass import DRAFT_FIELDS, sub_pass
from fixtures import plan_of
from models import MLP

lowering = importlib.import_module("dynaflow_fn.lowering.lower")


def _snapshot(value):
    """A value to compare before and after a sub-pass, which sees changes made in place."""
    if isinstance(value, (list, tuple)):
        return tuple(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _snapshot(v)) for k, v in value.items())
    if isinstance(value, set):
        return frozenset(value)
    if dataclasses.is_dataclass(value) and not value.__dataclass_params__.frozen:
        return dataclasses.astuple(value)
    return value


class AuditedDraft(PlanDraft):
    """A draft that records which of its fields are read and assigned while `log` is set."""

    def __getattribute__(self, name):
        if name in DRAFT_FIELDS:
            log = object.__getattribute__(self, "__dict__").get("log")
            if log is not None:
                log["read"].add(name)
        return super().__getattribute__(name)

    def __setattr__(self, name, value):
        log = self.__dict__.get("log")
        if log is not None and name in DRAFT_FIELDS:
            log["assigned"].add(name)
        super().__setattr__(name, value)


def _audited_run(sub_pass, seen):
    def run(draft):
        before = {name: _snapshot(object.__getattribute__(draft, name)) for name in DRAFT_FIELDS}
        draft.__dict__["log"] = {"read": set(), "assigned": set()}
        try:
            return sub_pass.run(draft)
        finally:
            log = draft.__dict__.pop("log")
            changed = {name for name in DRAFT_FIELDS if _snapshot(object.__getattribute__(draft, name)) != before[name]}
            seen.append((sub_pass, log["read"], log["assigned"] | changed))
    return run


def _programs():
    def attend(w, x):
        keep = torch.arange(8) % 2 == 0                              # setup work: depends on no input
        return (x @ w).masked_fill(keep, 0.0).relu().exp()

    def update(p, g):
        return p * 0.9 - g * 0.1

    def bump(x):
        x.add_(1)                                                    # an input mutation: a write-back
        return torch.cat([x * 2, x * 3])

    fn, params = df.pure(MLP())
    w, x = torch.randn(8, 8), torch.randn(8, 8)
    overlapped = T.overlap(T.microbatch(attend, num=2, in_axes=(None, 0)), "roundrobin")
    return [(df.trace(fn, params, torch.randn(4, 32)), None), (df.trace(attend, w, x), None),
            (df.trace(overlapped, w, x), None), (df.trace(update, w, x), {0: 0}), (df.trace(bump, x), None)]


def test_each_sub_pass_touches_only_the_draft_fields_it_declares(monkeypatch):
    seen = []
    monkeypatch.setattr(lowering, "PlanDraft", AuditedDraft)
    monkeypatch.setattr(lowering, "SUB_PASSES", tuple(
        dataclasses.replace(s, run=_audited_run(s, seen)) for s in lowering.SUB_PASSES))
    for program, donate in _programs():
        df.verify(df.lower(program, donate=donate))
    assert {s.name for s, _, _ in seen} == {s.name for s in lowering.SUB_PASSES}
    for declared, read, written in seen:
        assert written <= set(declared.writes), (declared.name, written - set(declared.writes))
        assert read <= set(declared.reads) | set(declared.writes), (declared.name, read - set(declared.reads))


def test_an_order_that_reads_a_field_before_it_is_written_is_refused(monkeypatch):
    passes = list(lowering.SUB_PASSES)
    order, reinplace = passes.index(next(s for s in passes if s.name == "issue order")), passes[2]
    passes[order], passes[2] = reinplace, passes[order]                 # reinplace before issue order
    monkeypatch.setattr(lowering, "SUB_PASSES", tuple(passes))
    fn, params = df.pure(MLP())
    with pytest.raises(InternalError, match="'reinplace' reads the draft's 'issue_order'"):
        plan_of(fn, params, torch.randn(4, 32))


def test_a_sub_pass_may_declare_only_fields_of_the_draft():
    with pytest.raises(InternalError, match=r"\['slot_names'\]"):
        sub_pass("naming", reads=("slots",), writes=("slot_names",))


def test_a_draft_prints_the_slots_and_steps_decided_so_far():
    fn, params = df.pure(MLP())
    program = df.trace(fn, params, torch.randn(4, 32))
    draft = PlanDraft(program, checked_donation(program, None))
    by_name = {s.name: s for s in lowering.SUB_PASSES}
    by_name["bind"](draft)
    bound = str(draft)
    assert bound.startswith("# draft of MLP:") and "x: f32[4, 32]  input" in bound
    assert bound.rstrip().endswith("steps:")                          # bound, but no step emitted yet
    for name in ("issue order", "reinplace", "emit steps"):
        by_name[name](draft)
    emitted = str(draft)
    assert "addmm_2 = aten.addmm.out(layers_2_bias, gelu_1, t_2)  -> arena" in emitted
    assert "t = aten.t(layers_0_weight)  [view]" in emitted
    assert emitted.count("\n    s0 ") == len(draft.steps) == len(program.ops())
    by_name["outputs"](draft)
    assert "addmm_2: f32[4, 16]  output" in str(draft)              # the returned buffer outlives the call
