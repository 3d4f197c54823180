"""A faithfulness search's steps kept on disk, so an interrupted search resumes where it stopped.

Each greedy step of the search (:mod:`~mistill_lens.lens.faithfulness`) is one joint ablation per
pool candidate over every discovery event: at n >= 150 examples one curve takes tens of minutes and
a run with several kinds, methods, random baselines and bootstrap resamples takes hours. A
:class:`SearchLog` records, under a key per curve, every step taken (the head added or removed and
the set's value), each learned mask's ranking, each resample's found set, and each kind's
finished result, rewriting its file (atomically) after each. A search given the log replays the
steps it holds without recomputing them and computes only the rest; the steps are deterministic
given the inputs, so a resumed search equals an uninterrupted one.

The file carries the fingerprint of its inputs (:mod:`~mistill_lens.lens.fingerprint`: the model's
weights, the events, the reference means, the search's options): a log from another run is refused
(``stale="error"``) or discarded with a :class:`~mistill_lens.lens.fingerprint.StaleResultWarning`
(``stale="recompute"``), never mixed in. Without a path the log lives in memory only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from mistill_lens.lens.fingerprint import check_stale, resumable

SEARCH_LOG_FORMAT = "1"


class SearchLog:
    """Steps and results of a search by key, in `path` (JSON) when one is given."""

    def __init__(
        self,
        path: str | Path | None,
        fingerprint: Mapping[str, str],
        stale: str = "error",
        what: str = "search log",
    ):
        check_stale(stale)
        self.path = Path(path) if path is not None else None
        self.what = what
        self.fingerprint = {"format": SEARCH_LOG_FORMAT, **fingerprint}
        self._steps: dict[str, list[dict]] = {}
        self._results: dict[str, Any] = {}
        if self.path is not None and self.path.is_file():
            self._resume(stale)

    def _resume(self, stale: str) -> None:
        stored = json.loads(self.path.read_text())
        what = f"{self.what} {self.path}"
        if not resumable(stored.get("fingerprint"), self.fingerprint, what, stale):
            return
        self._steps = stored["steps"]
        self._results = stored["results"]

    def steps(self, key: str) -> list[dict]:
        """The steps recorded under `key`, in order (empty: none yet)."""
        return list(self._steps.get(key, []))

    def record(self, key: str, step: dict) -> None:
        """Append one step under `key` and save."""
        self._steps.setdefault(key, []).append(step)
        self._save()

    def result(self, key: str) -> Any | None:
        """The finished result stored under `key` (None: not finished)."""
        return self._results.get(key)

    def finish(self, key: str, value: Any) -> None:
        """Store the finished result of `key` and save."""
        self._results[key] = value
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        text = json.dumps(
            {"fingerprint": self.fingerprint, "steps": self._steps, "results": self._results}
        )
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(text)
        os.replace(partial, self.path)  # a reader never sees half a file, even if killed here


def in_memory() -> SearchLog:
    """A log that keeps nothing on disk: a search run once, start to end."""
    return SearchLog(None, {})
