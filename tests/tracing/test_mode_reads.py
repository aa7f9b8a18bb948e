"""Recording which modules' `training` flags a trace reads changes nothing else about the flag."""

import pytest
import torch

from dynaflow_fn.tracing.mode_reads import recording_mode_reads


class _NeverInitialized(torch.nn.Module):
    def __init__(self):                      # skips nn.Module.__init__, so the module has no flag yet
        pass


def test_a_module_without_its_flag_fails_as_it_does_without_the_recorder():
    with pytest.raises(AttributeError) as plain:
        _NeverInitialized().training
    with recording_mode_reads() as reads:
        with pytest.raises(AttributeError) as recorded:
            _NeverInitialized().training
        assert not hasattr(_NeverInitialized(), "training")
        module = torch.nn.Linear(2, 2)
        assert module.training
    assert str(recorded.value) == str(plain.value) == "'_NeverInitialized' object has no attribute 'training'"
    assert list(reads.values()) == [(module, True)]
