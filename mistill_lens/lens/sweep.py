"""Exact ablation sweeps: every head x every event, one re-run per head.

`ablation_sweep` writes its table after each head, so an interrupted sweep resumes where it
stopped (heads already in the file are not re-run, after checking the file belongs to this run).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Iterable

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from mistill_lens.lens.backends import backend_for, clean_margins
from mistill_lens.lens.events import EventBatch
from mistill_lens.lens.fingerprint import (
    StaleResultError,
    check_stale,
    model_digest,
    read_fingerprint,
    resumable,
    tensor_digest,
    value_digest,
    write_fingerprint,
)
from mistill_lens.lens.hooks import (
    Head,
    HeadMeans,
    all_heads,
    validate_heads,
)
from mistill_lens.lens.model_types import HookedModel

SWEEP_COLUMNS = [
    "event_row",
    "example_id",
    "kind",
    "position",
    "layer",
    "head",
    "clean_margin",
    "ablated_margin",
    "effect",
    "fraction_lost",
]


def _sweep_rows(
    batch: EventBatch, head: Head, clean: Tensor, ablated: Tensor, rows: Tensor
) -> pd.DataFrame:
    """One head's rows for `batch`, the events at `rows` of the swept batch."""
    effect = clean - ablated
    fraction = torch.where(
        clean > 0, effect / clean.where(clean > 0, torch.ones_like(clean)), torch.nan
    )
    return pd.DataFrame(
        {
            "event_row": rows.tolist(),
            "example_id": [e.example_id for e in batch.events],
            "kind": batch.kinds,
            "position": [e.position for e in batch.events],
            "layer": head[0],
            "head": head[1],
            "clean_margin": clean.tolist(),
            "ablated_margin": ablated.tolist(),
            "effect": effect.tolist(),
            "fraction_lost": fraction.tolist(),
        }
    )


SWEEP_FORMAT = "sweep-v2"  # bump when the table's columns or meaning change


def events_digest(batch: EventBatch) -> str:
    """Digest of a batch's events: contexts, positions, chosen and contrast tokens, kinds."""
    return tensor_digest(
        batch.tokens, batch.predict_positions, batch.chosen, batch.contrast
    ) + value_digest(batch.kinds)


def means_digest(means: HeadMeans) -> str:
    """Digest of reference means: the values, their counts and class names."""
    return tensor_digest(means.means, means.counts) + value_digest(means.class_names)


def sweep_fingerprint(model: HookedModel, batch: EventBatch, means: HeadMeans) -> dict[str, str]:
    """What a sweep table's numbers depend on: the table format, the model's weights, the events
    (contexts, positions, chosen and contrast tokens) and the reference means."""
    return {
        "format": SWEEP_FORMAT,
        "model weights": model_digest(model),
        "events": events_digest(batch),
        "reference means": means_digest(means),
    }


def ablation_sweep(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    out_path: Path | None = None,
    heads: Iterable[Head] | None = None,
    progress: bool = True,
    batch_size: int = 256,
    stale: str = "error",
    clean: Float[Tensor, "event"] | None = None,
) -> pd.DataFrame:
    """Exact single-head mean-ablation effect of every head on every event (columns SWEEP_COLUMNS).

    `effect` = clean margin - ablated margin (logits); `fraction_lost` = effect / clean margin
    (NaN where the clean margin is not positive). The sweep takes every head through one block of
    examples at a time (the backend's `sweep_blocks`: on the engine, as many as its cache holds).
    With `out_path` (CSV) the table is appended after each head's block and a rerun computes only
    the (head, event) rows missing there (a line cut short by a kill is dropped). The table's fingerprint (model weights,
    events, reference means, format; `sweep_fingerprint`) is stored beside it: a table computed
    from other inputs is never resumed. `stale="error"` then raises `StaleResultError` naming the
    inputs that changed; `stale="recompute"` discards the table (with a warning) and starts again.
    `clean`: the events' clean margins, when the caller has them already.
    """
    check_stale(stale)
    heads = validate_heads(model, heads if heads is not None else all_heads(model))
    clean = clean if clean is not None else clean_margins(model, batch, batch_size=batch_size)
    done = pd.DataFrame(columns=SWEEP_COLUMNS)
    if out_path is not None:
        out_path = Path(out_path)
        fingerprint = sweep_fingerprint(model, batch, means)
        what = f"sweep table {out_path}"
        if out_path.exists() and resumable(
            read_fingerprint(out_path),
            fingerprint,
            what,
            stale,
            "use another output folder, or recompute it",
        ):
            done = _read_table(out_path)
        write_fingerprint(out_path, fingerprint)
    done = done.drop_duplicates(["layer", "head", "event_row"])
    if out_path is not None:
        done.to_csv(out_path, index=False)  # a stale table's rows gone before appending
    have = set(
        zip(
            done["layer"].astype(int).tolist(),
            done["head"].astype(int).tolist(),
            done["event_row"].astype(int).tolist(),
        )
    )
    frames = [done]
    backend = backend_for(model, batch_size)
    blocks = backend.sweep_blocks(batch)
    with tqdm(total=len(heads) * len(blocks), desc="ablation sweep", disable=not progress) as bar:
        for rows in blocks:  # every head through one block of examples, then the next
            todo = [h for h in heads if any((*h, int(r)) not in have for r in rows)]
            bar.update(len(heads) - len(todo))
            sub = batch.select(rows)
            for group in backend.sweep_groups(todo):
                ablated = backend.sweep_heads(sub, means, group)
                for head, margins in zip(group, ablated):
                    new = _sweep_rows(sub, head, clean[rows], margins, rows)
                    new = new[[(*head, r) not in have for r in new["event_row"]]]
                    if out_path is not None:
                        new.to_csv(out_path, mode="a", header=False, index=False)
                    frames.append(new)
                    bar.update(1)
    table = pd.concat([f for f in frames if len(f)], ignore_index=True)
    table = table.sort_values(["layer", "head", "event_row"], ignore_index=True)
    if out_path is not None:  # finished: the table in its final order, written by its owner once
        table.to_csv(out_path, index=False)
    return table


def read_table(path: str | Path | io.StringIO) -> pd.DataFrame:
    """A table this toolkit wrote, read back as written: only an empty field is missing (pandas
    would otherwise read the null event kind, "null", as NaN)."""
    return pd.read_csv(path, keep_default_na=False, na_values=[""])


def _read_table(path: Path) -> pd.DataFrame:
    text = path.read_text()
    if text and not text.endswith("\n"):  # killed mid-line: that row is not trusted
        text = text[: text.rfind("\n") + 1]
    if not text:
        return pd.DataFrame(columns=SWEEP_COLUMNS)
    done = read_table(io.StringIO(text))
    if list(done.columns) != SWEEP_COLUMNS:
        raise StaleResultError(
            f"sweep table {path} has columns {list(done.columns)}, expected {SWEEP_COLUMNS}"
        )
    return done


def effects_tensor(
    table: pd.DataFrame, n_events: int, n_layers: int, n_heads: int, column: str = "effect"
) -> Float[Tensor, "event layer head"]:
    """The sweep table as an [event, layer, head] tensor (NaN for heads not swept)."""
    effects = torch.full((n_events, n_layers, n_heads), torch.nan)
    effects[
        torch.tensor(table["event_row"].to_numpy()),
        torch.tensor(table["layer"].to_numpy()),
        torch.tensor(table["head"].to_numpy()),
    ] = torch.tensor(table[column].to_numpy(), dtype=torch.float32)
    return effects
