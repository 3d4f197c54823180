"""An event's attention rows for CircuitsVis: equal to the model's own hook_pattern rows (on the
full forward and on the engine), rendered offline by CircuitsVis in a real browser."""

import re

import pytest
import torch

from mistill_lens import task
from mistill_lens.lens.attention_view import (
    circuitsvis_view,
    event_attention_rows,
    write_circuitsvis_view,
)
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import events_from_spans
from mistill_lens.models.checkpoints import load_model


@pytest.fixture(scope="module")
def tiny_example():
    model, tokenizer = load_model("tiny")
    example = task.generate_examples(1, 0, "heldout", k=8, max_mentions=2)[0]
    return model, events_from_spans(example, tokenizer, 0)


def test_rows_are_the_models_own_attention_from_the_predicting_token(tiny_example):
    model, example = tiny_example
    event = 2
    query = example.events[event].predict_position
    tokens = torch.tensor([example.tokens])
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_pattern"))
    expected = torch.stack(
        [
            cache[f"blocks.{l}.attn.hook_pattern"][0, h, query, : query + 1]
            for l, h in [(0, 1), (3, 3)]
        ]
    )
    rows = event_attention_rows(model, example, event, ["L3H3", (0, 1)])  # sorted: L0H1, L3H3
    torch.testing.assert_close(rows, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(rows.sum(dim=1), torch.ones(2), atol=1e-5, rtol=0)
    on_engine = event_attention_rows(InterventionEngine(model), example, event, ["L0H1", "L3H3"])
    torch.testing.assert_close(on_engine, expected, atol=1e-5, rtol=0)


def test_bad_event_or_head_is_named(tiny_example):
    model, example = tiny_example
    with pytest.raises(ValueError, match=f"event {len(example.events)} is out of range"):
        event_attention_rows(model, example, len(example.events), ["L0H0"])
    with pytest.raises(IndexError, match="out of range"):
        event_attention_rows(model, example, 0, ["L9H0"])


def test_circuitsvis_renders_the_rows_offline_in_a_browser(tiny_example, tmp_path):
    from test_report import chromium

    pytest.importorskip("circuitsvis", reason="the circuitsvis extra is not installed")
    model, example = tiny_example
    view = circuitsvis_view(model, example, 1, ["L3H3", "L0H1"])
    assert "unpkg.com" not in view.local_src  # the JavaScript is inlined: opens offline
    page = write_circuitsvis_view(view, tmp_path / "view.html")
    dom = chromium(
        page, "--virtual-time-budget=5000", "--dump-dom", user_data=tmp_path / "profile"
    ).stdout
    rendered = re.sub(r"<script.*?</script>", "", dom, flags=re.S)  # what the page drew
    query = example.events[1].predict_position
    last = example.text[slice(*example.offsets[query])].replace("\n", "⏎")
    assert "L0H1" in rendered and "L3H3" in rendered  # one colouring per head, named
    assert f"{query}:{last}" in rendered  # the predicting token, as token_labels numbers it
