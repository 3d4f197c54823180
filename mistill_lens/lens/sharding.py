"""Exact sweeps sharded over a Ray cluster: the examples are split into shards, each shard's
sweep runs on the intervention engine in a Ray task and keeps its own resumable table, and the
merged table equals the single-process sweep.

Ray is an optional dependency (``pip install 'mistill_lens[ray]'``); ``address=None`` starts a
local instance, any other address joins that cluster (``ray.init(address=...)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pandas as pd
import torch

from mistill_lens.lens.engine import InterventionEngine, model_tensors, twin_of, unbridged
from mistill_lens.lens.events import EventBatch
from mistill_lens.lens.fingerprint import write_fingerprint
from mistill_lens.lens.hooks import Head, HeadMeans, all_heads, validate_heads
from mistill_lens.lens.model_types import HookedModel
from mistill_lens.lens.sweep import ablation_sweep, sweep_fingerprint


def shard_rows(batch: EventBatch, shards: int) -> list[list[int]]:
    """The batch's rows in `shards` groups of whole examples (an example's events share its
    clean pass), dealt in order of first appearance; empty groups are dropped."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    examples: dict[int, list[int]] = {}
    for row, event in enumerate(batch.events):
        examples.setdefault(event.example_id, []).append(row)
    groups: list[list[int]] = [[] for _ in range(shards)]
    for i, rows in enumerate(examples.values()):
        groups[i % shards].extend(rows)
    return [sorted(g) for g in groups if g]


def _ray():
    try:
        import ray
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "sharding over Ray needs the 'ray' package: pip install 'mistill_lens[ray]'"
        ) from err
    return ray


def _sweep_shard(
    weights, batch: EventBatch, means: HeadMeans, heads, out_path, stale: str
) -> pd.DataFrame:
    torch.set_num_threads(1)  # one core per task: Ray schedules the tasks over the cores
    model_class, config, tensors = weights
    return ablation_sweep(
        InterventionEngine(twin_of(model_class, config, tensors)),
        batch,
        means,
        out_path,
        heads=heads,
        progress=False,
        stale=stale,
    )


def sharded_sweep(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    out_path: Path | None = None,
    heads: Iterable[Head] | None = None,
    shards: int = 2,
    address: str | None = None,
    stale: str = "error",
) -> pd.DataFrame:
    """`ablation_sweep` of `batch` with its examples split into `shards` Ray tasks. With
    `out_path`, shard i keeps its table in ``out_path`` with ``.shard-i-of-n`` before the suffix
    (resumable, fingerprinted like any sweep table; `stale` as in `ablation_sweep`) and the
    merged table is written to `out_path`."""
    ray = _ray()
    heads = validate_heads(model, heads if heads is not None else all_heads(model))
    groups = shard_rows(batch, shards)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    # the model travels as its Hugging Face class, config and every tensor, buffers included (a
    # bridge does not pickle; a buffer rebuilt from the config may not be the model's)
    hf = unbridged(model)
    tensors = {name: t.detach() for name, t in model_tensors(hf).items()}
    weights = ray.put((type(hf), hf.config, tensors))
    task = ray.remote(num_cpus=1)(_sweep_shard)
    out_path = Path(out_path) if out_path is not None else None
    pending = []
    for i, rows in enumerate(groups):
        shard_path = None
        if out_path is not None:
            shard_path = out_path.with_suffix(f".shard-{i}-of-{len(groups)}{out_path.suffix}")
        pending.append(task.remote(weights, batch.select(rows), means, heads, shard_path, stale))
    frames = []
    for rows, table in zip(groups, ray.get(pending)):
        table = table.copy()
        table["event_row"] = [rows[r] for r in table["event_row"]]
        frames.append(table)
    merged = pd.concat(frames, ignore_index=True).sort_values(
        ["layer", "head", "event_row"], ignore_index=True
    )
    if out_path is not None:  # a finished sweep table, as a single-process run would leave it
        merged.to_csv(out_path, index=False)
        write_fingerprint(out_path, sweep_fingerprint(model, batch, means))
    return merged
