import pytest
import torch
from planted import REGIONS, TOKEN_ID, planted_examples
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mistill_lens.lens.events import (
    candidate_token_ids,
    events_from_generation,
    events_from_spans,
    make_event_batch,
)
from mistill_lens.lens.margins import decided_rows, decision_margins, margin_fraction, margins_at
from mistill_lens.models.generate import greedy_tokens


def char_tokenizer(tmp_path):
    """A character-level fast tokenizer: a code like "R12" is several tokens, as in a student."""
    chars = sorted(set("<>bosequ =R*sf0123456789.IXabcdn"))
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=" ", pad_token=" ")
    tokenizer.save_pretrained(tmp_path)
    return PreTrainedTokenizerFast.from_pretrained(tmp_path)


def test_gold_events_land_on_the_decided_token(planted):
    _, tokenizer = planted
    example = planted_examples(1, seed=3)[0]
    encoded = events_from_spans(example, tokenizer, example_id=7)
    region, within = encoded.events
    assert (region.kind, within.kind) == ("region", "within")
    assert (
        tokenizer.convert_ids_to_tokens(encoded.tokens[region.position])
        == example["events"][0]["chosen"]
    )
    assert region.chosen_token == TOKEN_ID[example["events"][0]["chosen"]]
    assert region.contrast_tokens == (TOKEN_ID[example["events"][0]["contrast"]],)
    assert encoded.tokens[region.predict_position] == TOKEN_ID["="]
    assert within.position == region.position + 1
    assert within.region == region.chosen == example["events"][0]["chosen"]
    assert encoded.prompt_tokens == 1 + 4 + 3


def test_multi_token_codes_use_the_first_differing_token(tmp_path):
    tokenizer = char_tokenizer(tmp_path)
    prompt = "codes I21 I25 ="
    output = " I21.4"
    text = prompt + output
    start = text.rindex("I21")
    example = {
        "prompt": prompt,
        "output": output,
        "events": [
            {
                "kind": "region",
                "start": start,
                "end": start + 3,
                "chosen": "I21",
                "contrast": "I25",
                "mention": 1,
                "region": "I21",
            },
            {
                "kind": "within",
                "start": start + 3,
                "end": start + 5,
                "chosen": ".4",
                "contrast": ".3",
                "mention": 1,
                "region": "I21",
            },
        ],
    }
    encoded = events_from_spans(example, tokenizer, example_id=0)
    region, within = encoded.events
    # "I", "2" are shared by I21 and I25: the decision is the third character
    assert region.position == start + 2
    assert tokenizer.convert_ids_to_tokens([region.chosen_token, region.contrast_tokens[0]]) == [
        "1",
        "5",
    ]
    assert within.position == start + 4  # "." is shared by .4 and .3
    assert within.region == "I21"


def test_bad_spans_are_rejected(planted):
    _, tokenizer = planted
    example = planted_examples(1, seed=0)[0]
    wrong = dict(
        example, events=[dict(example["events"][0], start=example["events"][0]["start"] + 1)]
    )
    with pytest.raises(ValueError, match="does not hold"):
        events_from_spans(wrong, tokenizer, 0)
    same = dict(
        example, events=[dict(example["events"][0], contrast=example["events"][0]["chosen"])]
    )
    with pytest.raises(ValueError, match="tokenize identically"):
        events_from_spans(same, tokenizer, 0)
    # kinds are data: a task's own kind is accepted, the reserved null kind and a nameless one are not
    kind = dict(example, events=[dict(example["events"][0], kind="chapter")])
    assert events_from_spans(kind, tokenizer, 0).events[0].kind == "chapter"
    for reserved in ("null", ""):
        with pytest.raises(
            ValueError, match="event kind must be a non-empty name other than 'null'"
        ):
            events_from_spans(
                dict(example, events=[dict(example["events"][0], kind=reserved)]), tokenizer, 0
            )


def test_margins_are_batched_and_exact(planted, planted_data):
    bridge, _ = planted
    batch = planted_data["batch"]
    logits = bridge(batch.tokens)
    margins = decision_margins(logits, batch)
    expected = torch.tensor([6.0 if k == "region" else 3.0 for k in batch.kinds])
    torch.testing.assert_close(margins, expected, atol=1e-4, rtol=0)
    # several contrasts: the best competitor counts
    two = torch.stack([batch.contrast[:, 0], batch.chosen], dim=1)
    assert torch.allclose(
        margins_at(logits, batch.predict_positions, batch.chosen, two),
        torch.zeros(len(batch)),
        atol=1e-6,
    )


def test_events_outside_the_context_are_rejected(planted_data):
    examples = planted_data["examples"]
    event = examples[0].events[0]
    from dataclasses import replace

    with pytest.raises(IndexError, match="outside the context"):
        make_event_batch(examples, [replace(event, position=len(examples[0].tokens))])
    with pytest.raises(IndexError, match="outside the context"):
        make_event_batch(examples, [replace(event, position=0)])


def test_nan_margins_and_undecided_normalisation_raise(planted_data):
    batch = planted_data["batch"]
    logits = torch.zeros(len(batch), batch.tokens.shape[1], 40)
    logits[0, batch.predict_positions[0], batch.chosen[0]] = torch.nan
    with pytest.raises(FloatingPointError, match="NaN"):
        decision_margins(logits, batch)
    with pytest.raises(ValueError, match="not positive"):
        margin_fraction(torch.ones(2), torch.tensor([1.0, 0.0]))
    with pytest.raises(FloatingPointError):
        margin_fraction(torch.tensor([torch.nan]), torch.ones(1))
    assert decided_rows(torch.tensor([1.0, -1.0, 0.5])).tolist() == [0, 2]
    torch.testing.assert_close(
        margin_fraction(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 3.0])),
        torch.tensor([0.5, 1.0]),
    )


def test_events_from_the_models_own_generation(planted):
    bridge, tokenizer = planted
    example = planted_examples(1, seed=5)[0]
    gold_region, gold_within = (e["chosen"] for e in example["events"])
    prompt_text = example["prompt"] + example["output"][: example["output"].index("=") + 1]
    prompt_ids = tokenizer(prompt_text)["input_ids"]
    generated = greedy_tokens(bridge, torch.tensor([prompt_ids]), max_new_tokens=2)[0].tolist()
    output = " " + tokenizer.decode(generated[len(prompt_ids) :])
    assert output.split() == [gold_region, gold_within]  # the planted heads decide correctly

    def locate(text):
        for token in text.split():
            kind = "region" if token in REGIONS else "within"
            start = text.index(token)
            yield kind, start, start + len(token)

    candidates = {
        "region": candidate_token_ids(tokenizer, r"R\d"),
        "within": candidate_token_ids(tokenizer, r"s\d"),
    }
    assert candidates["region"] == sorted(TOKEN_ID[r] for r in REGIONS)
    encoded = events_from_generation(
        bridge, tokenizer, prompt_text, output, locate, candidates, example_id=3
    )
    region, within = encoded.events
    assert region.chosen == gold_region and within.chosen == gold_within
    # the best competitor: every other region scores 0 at "=", so the first (lowest id) other one wins ties;
    # for the within decision the same; the margins are the planted gains
    batch = make_event_batch([encoded])
    torch.testing.assert_close(
        decision_margins(bridge(batch.tokens), batch), torch.tensor([6.0, 3.0]), atol=1e-4, rtol=0
    )
