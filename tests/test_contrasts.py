"""Contrasts the model picks (lens/contrasts.py): the strongest named rival by the clean logits,
read at each rival's own departure token, frozen; checked against a plain forward."""

import dataclasses
import json

import pytest
import torch
from test_events import char_tokenizer
from transformer_lens import TransformerBridge
from transformer_lens.utilities import get_act_name
from transformers import GPT2Config, GPT2LMHeadModel

from mistill_lens.lens.backends import clean_margins
from mistill_lens.lens.contrasts import freeze_contrasts, listed_contrasts, shared_positions
from mistill_lens.lens.events import events_from_spans, make_event_batch
from mistill_lens.lens.examples import read_examples

REGIONS = ["I21", "I25", "X45", "R40", "I31"]


def random_gpt2(tokenizer, seed: int) -> TransformerBridge:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4)
    return TransformerBridge.boot_transformers(
        "random-gpt2",
        hf_model=GPT2LMHeadModel(config).eval(),
        tokenizer=tokenizer,
        device="cpu",
        dtype=torch.float32,
    )


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """A random GPT-2 on a character tokenizer: a code is several tokens, so rivals depart at
    different tokens ("I21" from "X45" at the letter, from "I25" at the last digit)."""
    tokenizer = char_tokenizer(tmp_path_factory.mktemp("chars"))
    return random_gpt2(tokenizer, 0), tokenizer


def example(chosen: str, rivals, near_miss: str | None = None, listed=REGIONS) -> dict:
    prompt = "codes " + " ".join(listed) + " ="
    output = f" {chosen}.4"
    start = len(prompt) + 1
    events = [
        {
            "kind": "region",
            "start": start,
            "end": start + 3,
            "chosen": chosen,
            "contrast": rivals[0] if rivals else "R40",
            "rivals": rivals,
        }
    ]
    if near_miss is not None:
        events.append(
            {
                "kind": "near_miss",
                "start": start,
                "end": start + 3,
                "chosen": chosen,
                "contrast": near_miss,
            }
        )
    return {"prompt": prompt, "output": output, "events": events}


def margin_by_hand(bridge, tokens, position, chosen, contrast) -> float:
    with torch.no_grad():
        logits = bridge(torch.tensor([tokens]))[0, position - 1]
    return float(logits[chosen] - logits[contrast])


def test_the_strongest_rival_is_frozen_at_its_own_departure_token(char_model):
    bridge, tokenizer = char_model
    rivals = ["I25", "X45", "R40", "I31"]
    encoded = events_from_spans(example("I21", rivals), tokenizer, 0)
    event = encoded.events[0]
    assert {tokenizer.decode([r.contrast_token]) for r in event.rivals} == {"5", "X", "R", "3"}
    positions = {r.contrast: r.position for r in event.rivals}
    assert positions["X45"] == positions["I25"] - 2  # the letter, then the digit two on

    frozen, record = freeze_contrasts(bridge, [encoded])
    by_hand = {
        r.contrast: margin_by_hand(
            bridge, encoded.tokens, r.position, r.chosen_token, r.contrast_token
        )
        for r in event.rivals
    }
    strongest = min(by_hand, key=by_hand.get)
    (chosen,) = frozen[0].events
    assert chosen.contrast == strongest
    assert chosen.rivals is None and len(chosen.contrast_tokens) == 1
    assert chosen.position == positions[strongest]
    assert record["region"]["events"] == 1 and record["region"]["rivals"] == 4
    assert record["region"]["margin_strongest"] == pytest.approx(by_hand[strongest], abs=1e-4)
    assert record["region"]["margin_listed"] == pytest.approx(by_hand["I25"], abs=1e-4)
    assert record["region"]["listed_strongest"] == float(strongest == "I25")
    # the batch's clean margin is the margin against the frozen rival, read by a plain forward
    batch = make_event_batch(frozen)
    assert float(clean_margins(bridge, batch)) == pytest.approx(by_hand[strongest], abs=1e-4)


def test_an_intervention_never_repicks_the_rival(char_model):
    bridge, tokenizer = char_model
    letters = ["I21", "X21", "R21", "a21", "b21", "c21"]  # every rival departs at the letter
    examples = [
        events_from_spans(
            example(c, [r for r in letters if r != c], listed=letters[i:] + letters[:i]),
            tokenizer,
            i,
        )
        for i, c in enumerate(letters)
    ]
    frozen, _ = freeze_contrasts(bridge, examples)
    batch = make_event_batch(frozen)
    assert batch.contrast.shape == (len(letters), 1)
    # the same events with every rival at the frozen token as a contrast: re-picked under the
    # intervention (the margin against whichever is strongest then)
    repicked = make_event_batch(
        [
            dataclasses.replace(
                x,
                events=[
                    dataclasses.replace(
                        f,
                        contrast_tokens=tuple(
                            r.contrast_token for r in e.rivals if r.position == f.position
                        ),
                    )
                    for e, f in zip(x.events, y.events)
                ],
            )
            for x, y in zip(examples, frozen)
        ]
    )
    torch.testing.assert_close(clean_margins(bridge, repicked), clean_margins(bridge, batch))
    # an intervention that lifts one other rival's logit at every position: the frozen margin
    # is still measured against the frozen rival; re-picking would measure it against the lifted one
    lifted = next(
        r.contrast_token
        for r in examples[0].events[0].rivals
        if r.contrast != frozen[0].events[0].contrast
    )
    direction = bridge.W_U[:, lifted].detach()

    def lift(resid, hook):
        return resid + 300 * direction / direction.norm()

    hooks = [(get_act_name("resid_post", 1), lift)]
    held = clean_margins(bridge, batch, extra_hooks=hooks)
    moved = clean_margins(bridge, repicked, extra_hooks=hooks)
    with torch.no_grad():
        logits = bridge.run_with_hooks(batch.tokens, fwd_hooks=hooks)
    rows = torch.arange(len(batch))
    at = logits[rows, batch.predict_positions]
    by_hand = at[rows, batch.chosen] - at[rows, batch.contrast[:, 0]]
    torch.testing.assert_close(held, by_hand, atol=1e-4, rtol=0)
    assert float(held[0]) > float(moved[0]) + 0.5


def test_a_rival_decided_by_another_event_is_not_its_own(char_model):
    bridge, tokenizer = char_model
    # the near-miss event decides "I21" against "I25" at the last digit; a region rival "I25"
    # there is that decision, not the region event's own
    encoded = events_from_spans(example("I21", ["I25"], near_miss="I25"), tokenizer, 0)
    frozen, record = freeze_contrasts(bridge, [encoded])
    assert [e.kind for e in frozen[0].events] == ["near_miss"]
    assert record["region"]["no_rival"] == 1 and record["region"]["events"] == 0
    # with a rival of its own left, the region event keeps it and shares no token's contrast
    encoded = events_from_spans(example("I21", ["I25", "X45"], near_miss="I25"), tokenizer, 0)
    frozen, _ = freeze_contrasts(bridge, [encoded])
    region = next(e for e in frozen[0].events if e.kind == "region")
    assert region.contrast == "X45"
    assert shared_positions(frozen) == {}  # X45 departs at the letter, the near-miss at a digit
    # listed contrasts: the rivals are set aside, every event kept
    listed = listed_contrasts(
        [events_from_spans(example("I21", ["I25"], near_miss="I25"), tokenizer, 0)]
    )
    assert [(e.kind, e.contrast, e.rivals) for e in listed[0].events] == [
        ("region", "I25", None),
        ("near_miss", "I25", None),
    ]
    assert shared_positions(listed) == {"near_miss+region": {"positions": 1, "same_contrast": 1}}


def test_rivals_that_no_token_can_tell_apart(char_model):
    _, tokenizer = char_model
    # ".4" against ".41": the difference lies after the span, so no token of it decides
    data = example("I21", ["I25"])
    start = data["events"][0]["end"]
    data["events"].append(
        {
            "kind": "within",
            "start": start,
            "end": start + 2,
            "chosen": ".4",
            "contrast": ".3",
            "rivals": [".41", ".3"],
        }
    )
    within = events_from_spans(data, tokenizer, 0).events[1]
    assert [r.contrast for r in within.rivals] == [".3"]
    data["events"][1]["rivals"] = [".41"]
    with pytest.raises(ValueError, match="can be told apart"):
        events_from_spans(data, tokenizer, 0)


def test_rivals_in_the_jsonl_format(tmp_path):
    good = example("I21", ["I25", "X45"])
    bad_type = example("I21", "I25")
    bad_self = example("I21", ["I25", "I21"])
    path = tmp_path / "examples.jsonl"
    path.write_text(json.dumps(good) + "\n")
    assert read_examples(path)[0].events[0].rivals == ("I25", "X45")
    for bad in (bad_type, bad_self):
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match="line 1: event 0: rivals must be a list of texts"):
            read_examples(path)


def test_a_logged_choice_is_read_back_not_recomputed(char_model, tmp_path, monkeypatch):
    """With a log, each example's clean margins are kept as they are read: a second run takes
    them from the file (the model is made unable to run) and freezes the same contrasts with the
    same record; a log written for other weights is refused, or discarded on request."""
    import mistill_lens.lens.contrasts as contrasts
    from mistill_lens.lens.contrasts import contrast_log
    from mistill_lens.lens.fingerprint import StaleResultError, StaleResultWarning

    bridge, tokenizer = char_model
    letters = ["I21", "X21", "R21", "a21"]
    examples = [
        events_from_spans(example(c, [r for r in letters if r != c], near_miss="I25"), tokenizer, i)
        for i, c in enumerate(letters)
    ]
    path = tmp_path / "contrasts.json"
    first = freeze_contrasts(bridge, examples, log=contrast_log(path, bridge))
    assert path.is_file()

    def no_forward(*_, **__):
        raise AssertionError("the model ran again")

    monkeypatch.setattr(contrasts, "_logits_by_position", no_forward)
    assert freeze_contrasts(bridge, examples, log=contrast_log(path, bridge)) == first
    with pytest.raises(AssertionError, match="ran again"):  # an example the log lacks
        freeze_contrasts(
            bridge,
            examples + [events_from_spans(example("b21", letters), tokenizer, 9)],
            log=contrast_log(path, bridge),
        )
    monkeypatch.undo()
    other = random_gpt2(tokenizer, 1)
    with pytest.raises(StaleResultError, match="contrast log .* model weights"):
        contrast_log(path, other)
    with pytest.warns(StaleResultWarning, match="recomputed"):
        contrast_log(path, other, stale="recompute")
