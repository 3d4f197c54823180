"""Greedy decoding and the task metrics: code F1, region accuracy, near-miss accuracy.

Metrics, per gold mention, read the trace line whose mention text is the gold mention's:
* ``region_acc``: the line names the gold region;
* ``near_miss_acc``: the line names a real near-miss of the gold code that is among the
  candidates (sibling or excludes code), rejects it, and then writes the gold code;
* ``code_f1``: micro F1 of the final ``Codes:`` list against the gold codes, over all examples.

``per_mention`` keeps each mention's two outcomes (example index, mention index, region,
near-miss: 1 right, 0 wrong), so that two models decoded on the same prompts can be compared
mention by mention (`mistill_lens.distill.report.mention_comparison`).

``teacher_forced_events`` scores the decisions one by one instead: with the reference output in
context, each gold event's token is predicted (argmax) or not, at what loss, and by what margin
over its contrast. It separates "has not learned to select" from "derails while decoding".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from mistill_lens.lens.events import events_from_spans
from mistill_lens.models.generate import greedy_texts, model_device
from mistill_lens.task.examples import EVENT_KINDS, Example, parse_output
from mistill_lens.task.icd import Universe, load_universe

MAX_NEW_TOKENS = 400


@dataclass
class Scores:
    n: int = 0
    mentions: int = 0
    region_correct: int = 0
    near_miss_correct: int = 0
    true_positives: int = 0
    predicted: int = 0
    gold: int = 0
    exact: int = 0
    per_mention: list[dict] = field(default_factory=list)

    def add(self, example: Example, generated: str, universe: Universe) -> None:
        lines, codes = parse_output(generated)
        by_mention = {line.mention: line for line in lines}
        candidates = set(example.candidates)
        for index, mention in enumerate(example.mentions):
            line = by_mention.get(mention.text)
            self.mentions += 1
            region = near_miss = False  # a mention without its line is wrong on both
            if line is not None:
                region = line.region == mention.code.split(".")[0]
                valid_near_misses = set(universe.near_misses(mention.code)) & candidates
                near_miss = line.near_miss in valid_near_misses and line.code == mention.code
            self.region_correct += region
            self.near_miss_correct += near_miss
            self.per_mention.append(
                {
                    "example": self.n,
                    "mention": index,
                    "region": int(region),
                    "near_miss": int(near_miss),
                }
            )
        predicted, gold = set(codes), set(example.gold_codes)
        self.true_positives += len(predicted & gold)
        self.predicted += len(predicted)
        self.gold += len(gold)
        self.exact += generated == example.output
        self.n += 1

    def as_dict(self) -> dict:
        precision = self.true_positives / self.predicted if self.predicted else 0.0
        recall = self.true_positives / self.gold if self.gold else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return {
            "code_f1": round(f1, 4),
            "code_precision": round(precision, 4),
            "code_recall": round(recall, 4),
            "region_acc": round(self.region_correct / max(1, self.mentions), 4),
            "near_miss_acc": round(self.near_miss_correct / max(1, self.mentions), 4),
            "exact_match": round(self.exact / max(1, self.n), 4),
            "mentions": self.mentions,
            "n": self.n,
            "per_mention": list(self.per_mention),
        }


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    examples: list[Example],
    universe_size: int,
    *,
    batch_size: int = 1,
    progress: bool = True,
) -> tuple[dict, list[str]]:
    """Scores and the generated outputs, in example order (``batch_size`` prompts decoded together
    on the model's device)."""
    universe = load_universe(universe_size)
    with tqdm(total=len(examples), desc="evaluate", disable=not progress, file=sys.stderr) as bar:
        outputs = greedy_texts(
            model,
            tokenizer,
            [example.prompt for example in examples],
            MAX_NEW_TOKENS,
            batch_size,
            on_batch=bar.update,
        )
    scores = Scores()
    for example, generated in zip(examples, outputs):
        scores.add(example, generated, universe)
    return {
        **scores.as_dict(),
        "teacher_forced": teacher_forced_events(model, tokenizer, examples),
    }, outputs


@torch.no_grad()
def teacher_forced_events(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, examples: list[Example]
) -> dict[str, dict[str, float]]:
    """Per event kind: ``n``, ``acc`` (the chosen token is the argmax), ``loss`` (nats) and
    ``margin`` (mean logit(chosen) - logit(contrast)), with the reference output in context."""
    totals = {kind: {"n": 0, "acc": 0.0, "loss": 0.0, "margin": 0.0} for kind in EVENT_KINDS}
    for example_id, example in enumerate(examples):
        encoded = events_from_spans(example, tokenizer, example_id)
        tokens = torch.tensor([encoded.tokens], device=model_device(model))
        logits = model(tokens).logits[0].float().cpu()
        for event in encoded.events:
            row = logits[event.predict_position]
            total = totals[event.kind]
            total["n"] += 1
            total["acc"] += float(row.argmax().item() == event.chosen_token)
            total["loss"] -= row.log_softmax(-1)[event.chosen_token].item()
            total["margin"] += (
                row[event.chosen_token] - row[list(event.contrast_tokens)].max()
            ).item()
    return {
        kind: {"n": t["n"], **{k: round(t[k] / t["n"], 4) for k in ("acc", "loss", "margin")}}
        for kind, t in totals.items()
        if t["n"]
    }
