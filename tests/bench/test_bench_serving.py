"""bench/serving.py imports and parses its cases anywhere; what needs no GPU (the batch walk) is checked here."""

import os

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.fixture
def serving(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import serving

    return serving


def test_the_batch_walk_is_seeded_and_stays_in_1_to_256(serving):
    walk = serving.batch_walk(serving.WALK_STEPS, serving.WALK_LARGEST)
    assert walk == serving.batch_walk(serving.WALK_STEPS, serving.WALK_LARGEST)
    assert len(walk) == 200 and min(walk) >= 1 and max(walk) <= 256
    assert max(abs(a - b) for a, b in zip(walk, walk[1:])) <= 16 and len(set(walk)) > 20


def test_every_case_is_selectable_and_skipped_without_a_gpu(serving, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    serving.main(["--cases", "decode-walk", "serve-llama", "llama"])
    assert "skipped decode-walk, serve-llama, llama" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        serving.main(["--cases", "no-such-case"])


def test_the_exact_size_variants_plan_sizes_spread_over_the_walk(serving):
    visited = sorted(set(serving.batch_walk(serving.WALK_STEPS, serving.WALK_LARGEST)))
    picked = serving.spread(visited, serving.WALK_SAMPLE)
    assert len(set(picked)) == serving.WALK_SAMPLE and set(picked) <= set(visited)
    assert picked == sorted(picked) and picked[0] == visited[0] and picked[-1] == visited[-1]
    assert serving.spread(visited[:5], 16) == visited[:5]
