"""Task metrics: perfect on the reference output, and each metric falls where its part is wrong."""

import math
from types import SimpleNamespace

import pytest
import torch

from mistill_lens import task
from mistill_lens.lens.events import events_from_spans
from mistill_lens.models.tokenizers import teacher_tokenizer
from mistill_lens.task.examples import EVENT_KINDS
from mistill_lens.task.icd import load_universe
from mistill_lens.task.metrics import Scores, teacher_forced_events


@pytest.fixture(scope="module")
def examples():
    return task.generate_examples(40, 2, "heldout")


def _score(examples, rewrite):
    scores = Scores()
    for ex in examples:
        scores.add(ex, rewrite(ex), load_universe())
    return scores.as_dict()


def test_reference_outputs_score_perfectly(examples):
    result = _score(examples, lambda ex: ex.output)
    assert (
        result["code_f1"]
        == result["region_acc"]
        == result["near_miss_acc"]
        == result["exact_match"]
        == 1.0
    )
    assert result["n"] == 40 and result["mentions"] == sum(len(ex.mentions) for ex in examples)


def test_a_wrong_sibling_costs_f1_and_near_miss_but_not_region(examples):
    def swap_first_code(ex):
        mention = ex.mentions[0]
        return ex.output.replace(f"code {mention.code}\n", f"code {mention.near_miss}\n").replace(
            task.CODES_HEADER + mention.code, task.CODES_HEADER + mention.near_miss
        )

    result = _score(examples, swap_first_code)
    n_mentions = sum(len(ex.mentions) for ex in examples)
    assert result["near_miss_acc"] == pytest.approx(
        (n_mentions - len(examples)) / n_mentions, abs=1e-4
    )
    assert result["region_acc"] == 1.0
    assert result["code_precision"] < 1.0 and result["code_recall"] < 1.0
    # mention by mention: exactly each example's first mention misses its near-miss
    assert [(m["example"], m["mention"]) for m in result["per_mention"]] == [
        (i, j) for i, ex in enumerate(examples) for j in range(len(ex.mentions))
    ]
    assert [m["near_miss"] for m in result["per_mention"]] == [
        int(j > 0) for ex in examples for j in range(len(ex.mentions))
    ]
    assert all(m["region"] == 1 for m in result["per_mention"])


def test_naming_a_candidate_that_is_not_a_near_miss_fails_near_miss_acc(examples):
    def name_a_distractor(ex):
        mention = ex.mentions[0]
        near_misses = set(load_universe().near_misses(mention.code))
        distractor = next(c for c in ex.candidates if c not in near_misses and c != mention.code)
        return ex.output.replace(f"near-miss {mention.near_miss} ", f"near-miss {distractor} ", 1)

    result = _score(examples, name_a_distractor)
    assert result["near_miss_acc"] < 1.0 and result["code_f1"] == 1.0


def test_malformed_output_scores_zero(examples):
    result = _score(examples, lambda ex: "garbage\n")
    assert result["code_f1"] == result["region_acc"] == result["near_miss_acc"] == 0.0


class _NextTokenOracle(torch.nn.Module):
    """A planted model: logit 4 on the reference next token (optionally on the event's contrast
    instead), 0 elsewhere, so every teacher-forced figure has a closed form."""

    def __init__(self, vocab_size: int, prefer_contrast_at: dict[int, int] | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.prefer_contrast_at = prefer_contrast_at or {}

    def forward(self, ids):
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.vocab_size)
        for position in range(ids.shape[1] - 1):
            logits[0, position, self.prefer_contrast_at.get(position, ids[0, position + 1])] = 4.0
        return SimpleNamespace(logits=logits)


def test_teacher_forced_events_have_closed_form_scores(examples):
    tokenizer = teacher_tokenizer()
    vocab = len(tokenizer)
    expected_loss = -(4.0 - math.log(math.exp(4.0) + vocab - 1))
    perfect = teacher_forced_events(_NextTokenOracle(vocab), tokenizer, examples[:5])
    assert set(perfect) == set(EVENT_KINDS)
    for kind, scores in perfect.items():
        assert scores["acc"] == 1.0 and scores["margin"] == 4.0
        assert scores["loss"] == pytest.approx(expected_loss, abs=1e-3)

    encoded = events_from_spans(examples[0], tokenizer, 0)
    region = next(e for e in encoded.events if e.kind == "region")
    fooled = teacher_forced_events(
        _NextTokenOracle(vocab, {region.predict_position: region.contrast_tokens[0]}),
        tokenizer,
        examples[:1],
    )
    n_region = fooled["region"]["n"]
    assert fooled["region"]["acc"] == pytest.approx((n_region - 1) / n_region, abs=1e-4)
    assert fooled["region"]["margin"] == pytest.approx(4.0 * (n_region - 2) / n_region, abs=1e-4)


def test_shipped_teacher_selects_from_the_context_on_heldout_codes():
    """The shipped teacher decides held-out region and near-miss tokens better than the best
    context-blind guess. At its K = 4, copying a random candidate's region is right
    about 3 times in 4, and guessing among the gold region's 2-3 candidates at most 1 in 2;
    measured 2026-12-03 on these 48 examples: region 0.94, near-miss 0.81 teacher-forced."""
    from mistill_lens.models.checkpoints import load_hf_model, read_metadata

    model, tokenizer = load_hf_model("tiny")
    config = read_metadata("tiny")["config"]
    heldout = task.generate_examples(
        48, 7, "heldout", k=config["k"], max_mentions=config["max_mentions"]
    )
    scores = teacher_forced_events(model.eval(), tokenizer, heldout)
    assert scores["region"]["acc"] > 0.85
    assert scores["near_miss"]["acc"] > 0.55
