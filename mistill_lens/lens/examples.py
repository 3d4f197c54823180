"""Your own task: examples as JSONL, one object per line, nothing task-specific required.

Format (one line per example)::

    {"prompt": "...", "output": "...",
     "events": [{"kind": "answer", "start": 57, "end": 60, "chosen": "yes", "contrast": "no"}, ...]}

* ``prompt`` and ``output`` are strings; the model reads ``prompt + output``.
* each event is a decision: ``kind`` is any name (kinds are data; ``null`` is reserved for null
  events), ``start`` / ``end`` are character offsets into ``prompt + output`` with
  ``(prompt + output)[start:end] == chosen``, and ``contrast`` is the competing text that could
  stand at ``start`` instead. The decision sits at the first token where the two differ.
* optional per event: ``region`` (text whose occurrences in the prompt are the decision's
  candidates, for head families) and ``mention`` (an integer index for task readers).
* optional per event: ``rivals``, every text of the event's kind that could stand at ``start``
  (for the ICD task's region decision, the other regions among the candidates). A
  characterisation then scores the event against the rival the model itself ranks highest at its
  clean run, frozen for every intervention (:mod:`mistill_lens.lens.contrasts`); ``contrast``
  stays the event's listed stand-in where no model picks. An empty list marks an event with no
  rival of its own (it is left out when contrasts are the model's).
* optional per example: ``id`` (any JSON value), kept for reference.

``mistill-lens data`` writes the ICD task's examples in a superset of this format, so its files
read here too.

Short outputs are fine: null events then come from the whole text (see
:func:`mistill_lens.lens.calibration.null_events`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from mistill_lens.lens.events import NULL_KIND

T = TypeVar("T")

REQUIRED_EVENT_FIELDS = ("kind", "start", "end", "chosen", "contrast")


@dataclass(frozen=True)
class SpanEvent:
    """A decision in an example's text: ``(prompt + output)[start:end] == chosen``, where the model
    could have written `contrast` instead. `kind` is any name (kinds are data); `mention` is an
    index the task uses to find what the event refers to (-1: none); `region` is text whose
    occurrences in the prompt are the decision's candidate region, for head families ("": none);
    `rivals` are the texts a model's clean run picks the contrast from (None: `contrast` alone).
    The ICD task's gold events are of this type too."""

    kind: str
    start: int
    end: int
    chosen: str
    contrast: str
    mention: int = -1
    region: str = ""
    rivals: tuple[str, ...] | None = None


def span_event(row: dict) -> SpanEvent:
    """A :class:`SpanEvent` from its JSON object (`rivals` back to a tuple)."""
    rivals = row.get("rivals")
    return SpanEvent(**{**row, "rivals": None if rivals is None else tuple(rivals)})


@dataclass(frozen=True)
class SpanExample:
    prompt: str
    output: str
    events: tuple[SpanEvent, ...]
    id: Any = None
    # where it was read ("examples.jsonl, line 3"), so that a problem found later names it
    source: str = field(default="", compare=False)

    @property
    def text(self) -> str:
        return self.prompt + self.output


def _example(row: Any, source: str = "") -> SpanExample:
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    for name in ("prompt", "output", "events"):
        if name not in row:
            raise ValueError(f"missing field {name!r}")
    if not isinstance(row["prompt"], str) or not isinstance(row["output"], str):
        raise ValueError("prompt and output must be strings")
    if not isinstance(row["events"], list):
        raise ValueError("events must be a list")
    text = row["prompt"] + row["output"]
    events = []
    for index, event in enumerate(row["events"]):
        missing = [name for name in REQUIRED_EVENT_FIELDS if name not in event]
        if missing:
            raise ValueError(f"event {index} is missing field(s) {missing}")
        start, end = event["start"], event["end"]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(text)):
            raise ValueError(
                f"event {index}: span [{start}, {end}) is not inside prompt + output "
                f"({len(text)} characters)"
            )
        if text[start:end] != event["chosen"]:
            raise ValueError(
                f"event {index}: (prompt + output)[{start}:{end}] is {text[start:end]!r}, "
                f"not its chosen text {event['chosen']!r}"
            )
        kind = event["kind"]
        if not isinstance(kind, str) or not kind or kind == NULL_KIND:
            raise ValueError(
                f"event {index}: kind must be a non-empty name other than {NULL_KIND!r} (reserved "
                f"for null events), got {kind!r}"
            )
        if not isinstance(event["contrast"], str) or event["contrast"] == event["chosen"]:
            raise ValueError(
                f"event {index}: contrast {event['contrast']!r} must be a text other than the "
                f"chosen {event['chosen']!r}: the decision is where they differ"
            )
        rivals = event.get("rivals")
        if rivals is not None and (
            not isinstance(rivals, list)
            or not all(isinstance(r, str) and r != event["chosen"] for r in rivals)
        ):
            raise ValueError(
                f"event {index}: rivals must be a list of texts other than the chosen "
                f"{event['chosen']!r}, got {rivals!r}"
            )
        events.append(
            SpanEvent(
                str(event["kind"]),
                start,
                end,
                event["chosen"],
                event["contrast"],
                mention=int(event.get("mention", -1)),
                region=str(event.get("region", "")),
                rivals=None if rivals is None else tuple(rivals),
            )
        )
    return SpanExample(row["prompt"], row["output"], tuple(events), row.get("id"), source)


def read_jsonl(path: str | Path, parse: Callable[[Any, str], T]) -> list[T]:
    """Each non-empty line of a JSONL file through `parse(row, "FILE, line N")`; a bad line is an
    error naming the file, the line number and what is wrong (invalid JSON, a missing field, a
    malformed value)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"examples file {path} does not exist")
    rows = []
    with path.open("rb") as f:  # decoded line by line, so an undecodable byte names its line
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}, line {number}: not UTF-8 (byte {raw[err.start]:#04x} at column "
                    f"{err.start + 1}): save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                rows.append(parse(json.loads(line), f"{path}, line {number}"))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}, line {number}: not valid JSON ({err.msg} at column {err.colno})"
                ) from err
            except KeyError as err:
                raise ValueError(f"{path}, line {number}: missing field {err.args[0]!r}") from err
            except (ValueError, TypeError, AttributeError) as err:
                raise ValueError(f"{path}, line {number}: {err}") from err
    return rows


def _attribute(example: Any, name: str) -> Any:
    return example.get(name) if isinstance(example, dict) else getattr(example, name, None)


def own_id(example: Any) -> Any:
    """The example's own ``id`` (a dict's key or an attribute), None when it has none."""
    return _attribute(example, "id")


def example_name(example: Any, index: int) -> str:
    """How an error names an example: where it was read and its own ``id`` when it has them,
    else its place in the list."""
    source, own = _attribute(example, "source"), own_id(example)
    name = source or f"example {index}"
    return f"{name} (id {own!r})" if own is not None else name


def read_examples(path: str | Path) -> list[SpanExample]:
    """Examples from a JSONL file in the format above (errors as :func:`read_jsonl`)."""
    examples = read_jsonl(path, _example)
    if not examples:
        raise ValueError(f"examples file {path} holds no example")
    return examples
