"""Copied-in inputs reach their static buffers, grouped by dtype into one foreach copy each, detached
from autograd; an input of another device than the graph's is copied alone, by copy_."""

import pytest
import torch

from dynaflow_fn.runtime.copy_in import CopyIn


def _buffers_like(tensors, device):
    return [torch.empty_like(t, device=device) for t in tensors]


def test_every_copied_input_reaches_its_buffer_and_one_dtype_is_one_group():
    examples = [torch.zeros(2, 3, dtype=torch.int64), torch.zeros(4), torch.zeros(3, 1, dtype=torch.int64),
                torch.zeros(5, dtype=torch.bool), torch.zeros(()), torch.zeros(2)]
    buffers = _buffers_like(examples, "cpu")
    copied = [0, 1, 2, 3, 4]                        # the last one is resident: never copied
    copy_in = CopyIn(buffers, copied, examples, torch.device("cpu"))
    assert sorted(indices for indices, _ in copy_in.batched) == [[0, 2], [1, 4], [3]] and not copy_in.alone
    for _ in range(2):
        inputs = [torch.randint(0, 9, (2, 3)), torch.randn(4), torch.randint(0, 9, (3, 1)),
                  torch.rand(5) > 0.5, torch.randn(()), torch.randn(2)]
        buffers[5].fill_(7.0)
        copy_in(inputs)
        for i in copied:
            assert torch.equal(buffers[i], inputs[i])
        assert torch.equal(buffers[5], torch.full((2,), 7.0))


def test_a_source_that_requires_grad_is_copied_outside_autograd():
    examples = [torch.zeros(3), torch.zeros(3)]
    buffers = _buffers_like(examples, "cpu")
    copy_in = CopyIn(buffers, [0, 1], examples, torch.device("cpu"))
    sources = [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)]
    copy_in(sources)
    assert all(b.grad_fn is None and not b.requires_grad for b in buffers)
    assert all(torch.equal(b, s.detach()) for b, s in zip(buffers, sources))


@pytest.mark.cuda
def test_on_cuda_inputs_of_another_device_are_copied_alone():
    examples = [torch.zeros(4, dtype=torch.int64, device="cuda"), torch.zeros(4, dtype=torch.int64),
                torch.zeros(2, 2, dtype=torch.int64, device="cuda"), torch.zeros(3, device="cuda")]
    buffers = _buffers_like(examples, "cuda")
    copy_in = CopyIn(buffers, [0, 1, 2, 3], examples, torch.device("cuda", torch.cuda.current_device()))
    assert sorted(indices for indices, _ in copy_in.batched) == [[0, 2], [3]]
    assert [i for i, _ in copy_in.alone] == [1]
    for _ in range(3):
        inputs = [torch.randint(0, 9, t.shape, device=t.device) for t in examples[:3]] + [torch.randn(3, device="cuda")]
        copy_in(inputs)
        torch.cuda.synchronize()
        assert all(torch.equal(b.cpu(), s.cpu()) for b, s in zip(buffers, inputs))
