"""What a trace records of autograd: which outputs eager PyTorch would connect to which inputs, and which
inputs the function updates in place while gradients are recorded."""

import threading

import torch

import dynaflow_fn as df


def _flow(fn, *args):
    return df.trace(fn, *args).gradient_flow


def test_the_functions_own_grad_disabling_blocks_are_seen_as_blocks_and_decorators():
    @torch.no_grad()
    def decorated(x):
        return x * 2

    def blocks(a, b, c, d):
        with torch.no_grad():
            first = a * 2
        with torch.set_grad_enabled(False):
            second = b * 2
        with torch.inference_mode():
            third = c + 1
        with torch.no_grad(), torch.enable_grad():
            fourth = d * 2                                       # enabled again inside
        return first, second, third, decorated(a), fourth, a * b

    originals = [vars(cls)[name] for cls in (torch.no_grad, torch.set_grad_enabled, torch.inference_mode)
                 for name in ("__enter__", "__exit__")]
    flow = _flow(blocks, *(torch.randn(3) for _ in range(4)))
    assert flow.outputs == ((), (), (), (), (3,), (0, 1)) and flow.updated == ()
    assert originals == [vars(cls)[name] for cls in (torch.no_grad, torch.set_grad_enabled, torch.inference_mode)
                         for name in ("__enter__", "__exit__")]                 # put back after the trace


def test_grad_modes_of_other_threads_are_not_counted():
    entered = threading.Event()
    release = threading.Event()

    def other():
        with torch.no_grad():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(10)
    try:
        flow = _flow(lambda x: x * 2, torch.randn(3))
    finally:
        release.set()
        thread.join()
    assert flow.outputs == ((0,),)


def test_updates_in_place_follow_tensors_not_values():
    def f(a, b, w):
        a[0].add_(w[0])                                          # through a view: `a` now depends on w
        with torch.no_grad():
            b.mul_(w)                                            # not recorded: `b` is as it was
        return a * 2, b * 2

    flow = _flow(f, torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 2))
    assert flow.outputs == ((0, 2), (1,)) and flow.updated == (0,)


def test_gradients_computed_by_autograd_are_connected_to_nothing():
    w = torch.randn(4, 4, requires_grad=True)
    flow = _flow(df.value_and_grad(lambda x: (x @ w).square().sum()), torch.randn(2, 4))
    assert flow.outputs == ((), ())


def test_what_detach_returns_is_connected_to_nothing_however_torch_traces_it():
    def f(x, w):
        y = x.detach() * w                                       # depends on w alone
        return y, torch.detach(x * w), (x * w).detach().view(-1)

    flow = _flow(f, torch.randn(3), torch.randn(3))
    assert flow.outputs == ((1,), (), ())
