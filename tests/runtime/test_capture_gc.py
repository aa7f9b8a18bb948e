"""The pause of Python's cyclic collector around a CUDA-graph capture (`runtime.cudagraph.without_automatic_gc`);
the capture it protects is tested in test_cudagraph.py."""

import gc

from dynaflow_fn.runtime.cudagraph import without_automatic_gc


def test_the_collector_stays_paused_until_the_last_of_overlapping_captures_ends():
    assert gc.isenabled()
    first, second = without_automatic_gc(), without_automatic_gc()     # two threads' captures, say
    first.__enter__()
    second.__enter__()
    assert not gc.isenabled()
    first.__exit__(None, None, None)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    try:
        with without_automatic_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_runs_again_after_a_capture_that_raised():
    try:
        with without_automatic_gc():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
