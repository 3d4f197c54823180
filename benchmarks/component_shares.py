"""The MLPs' and attention blocks' shares of the default teacher's margins, per kind and layer, at
the events' predicting positions (held-out examples at the teacher's K, per-kind reference means
from separate examples): `python benchmarks/component_shares.py N SEED OUT_DIR`. Prints one line
per site and kind; writes the tables as CSV."""

import sys
import time
from pathlib import Path

import mistill_lens as ml
from mistill_lens.lens.characterize import REFERENCE_ID_OFFSET, encode
from mistill_lens.lens.components import SITES, component_shares
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import make_event_batch
from mistill_lens.lens.margins import decided_rows
from mistill_lens.models.checkpoints import read_metadata
from mistill_lens.task.characterize import task_examples


def main(n: int, seed: int, out: Path) -> None:
    model, tokenizer = ml.load_model("default")
    trained = read_metadata("default")["config"]
    task = {key: trained[key] for key in ("universe_size", "k", "max_mentions")}
    examples, reference = task_examples(n, seed, "heldout", task)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = InterventionEngine(model)
    batch = make_event_batch(encode(examples, tokenizer), pad_token_id=pad)
    batch = batch.select(decided_rows(engine.margins(batch, lambda view: [])))
    ref = make_event_batch(
        encode(reference, tokenizer, first_id=REFERENCE_ID_OFFSET), pad_token_id=pad
    )
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    for site in SITES:
        table = component_shares(engine, batch, ref, site)
        table.to_csv(out / f"shares_{site}.csv", index=False)
        for kind, rows in table.groupby("kind", sort=False):
            top = rows.sort_values("single", ascending=False).head(3)
            print(
                f"{site} {kind}: n {int(rows.n_events.iloc[0])}, all layers "
                f"{float(rows.cumulative.iloc[-1]):.3f}, top single layers "
                + ", ".join(f"L{int(r.layer)} {float(r.single):.3f}" for r in top.itertuples())
            )
    print(f"seconds {time.time() - start:.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
