"""`@df.jit` on a method: bound to each instance, one jitted function per instance that reuses its plans,
reading the instance's tensors in place and seeing its attributes change."""

import copy
import gc
import pickle
import sys
import weakref

import pytest
import torch
from torch import nn

import dynaflow_fn as df


class Scaler:
    def __init__(self):
        self.weight, self.temperature = torch.randn(4), 2.0

    @df.jit
    def apply(self, x):
        return torch.tanh(x * self.weight) / self.temperature

    def eager(self, x):
        return torch.tanh(x * self.weight) / self.temperature


def test_a_jitted_method_is_bound_per_instance_and_reuses_its_plans():
    first, second = Scaler(), Scaler()
    assert first.apply is first.apply and first.apply is not second.apply and Scaler.apply.fn is Scaler.__dict__["apply"].fn
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(first.apply(x), first.eager(x), rtol=0, atol=0)
        torch.testing.assert_close(second.apply(x), second.eager(x), rtol=0, atol=0)
    assert first.apply.cache_info().misses == 1 and first.apply.cache_info().hits == 2


def test_a_jitted_method_sees_its_instance_change():
    scaler = Scaler()
    scaler.apply(torch.randn(4))
    changes = [lambda: scaler.weight.mul_(3),                          # in place: read in place
               lambda: setattr(scaler, "weight", torch.randn(4)),      # another tensor
               lambda: setattr(scaler, "temperature", 0.5)]            # a scalar the trace baked in
    for change in changes:
        change()
        x = torch.randn(4)
        torch.testing.assert_close(scaler.apply(x), scaler.eager(x), rtol=0, atol=0)
    assert scaler.apply.cache_info().misses == 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    @df.jit
    def forward(self, x):
        return self.fc(x).relu()


def test_a_jitted_forward_sees_its_module_change():
    block = Block()
    with torch.no_grad():
        block(torch.randn(2, 8))
        block.fc = nn.Linear(8, 8)
        x = torch.randn(2, 8)
        torch.testing.assert_close(block(x), block.fc(x).relu(), rtol=0, atol=0)


class Accumulator:
    @df.jit(donate_argnums=(1,))
    def step(self, total, x):
        return total + x


def test_argument_positions_of_a_jitted_method_count_self():
    total = torch.zeros(3)
    x = torch.randn(3)
    assert Accumulator().step(total, x) is total and torch.equal(total, x)

    class SelfDonated:
        @df.jit(donate_argnums=(0,))
        def step(self, total):
            return total * 2

    with pytest.raises(df.InputError, match=r"position 0, which is `self`"):
        SelfDonated().step(total)


def test_an_instance_without_a_dict_is_refused_with_the_way_out():
    class Slotted:
        __slots__ = ("w",)

        @df.jit
        def apply(self, x):
            return x * 2

    with pytest.raises(df.InputError, match=r"add '__dict__' to its __slots__.*df\.jit\(obj\.apply\)"):
        Slotted().apply(torch.randn(2))


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="from Python 3.13 classmethod no longer binds through "
                    "the descriptor it wraps: the class arrives as an argument, which df.jit refuses by name")
def test_a_jitted_classmethod_binds_its_class_and_sees_its_attributes_change():
    """`@classmethod` over `@df.jit` binds the class, whose __dict__ is read-only: it raised
    "'mappingproxy' object does not support item assignment"."""
    class Scaled:
        factor = 2.0

        @classmethod
        @df.jit
        def apply(cls, x):
            return x * cls.factor

    x = torch.randn(3)
    torch.testing.assert_close(Scaled.apply(x), x * 2)
    Scaled.factor = 3.0
    torch.testing.assert_close(Scaled.apply(x), x * 3)


def test_something_other_than_a_function_is_refused_when_jitted():
    with pytest.raises(df.InputError, match=r"df\.jit compiles a function, got int 5"):
        df.jit(5)


def test_a_freed_instance_frees_its_jitted_method():
    scaler = Scaler()
    scaler.apply(torch.randn(4))
    method = weakref.ref(scaler.apply)
    del scaler
    gc.collect()
    assert method() is None


def test_copies_of_an_instance_bind_their_own_jitted_method():
    block = Block()
    with torch.no_grad():
        block(torch.randn(2, 8))
        for copied in (copy.copy(block), copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
            nn.init.normal_(copied.fc.weight) if copied.fc is not block.fc else None
            x = torch.randn(2, 8)
            torch.testing.assert_close(copied(x), copied.fc(x).relu(), rtol=0, atol=0)
            assert copied.forward is not block.forward
