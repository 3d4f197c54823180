"""The sweep sharded over a local Ray instance (2 CPUs) equals the single-process sweep."""

import pytest
import torch

from mistill_lens.lens.sharding import shard_rows, sharded_sweep
from mistill_lens.lens.sweep import ablation_sweep, effects_tensor

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_shards_hold_whole_examples(planted_data):
    batch = planted_data["batch"]
    groups = shard_rows(batch, 3)
    assert sorted(r for g in groups for r in g) == list(range(len(batch)))
    owner = {}
    for i, rows in enumerate(groups):
        for r in rows:
            assert owner.setdefault(batch.events[r].example_id, i) == i
    with pytest.raises(ValueError, match="at least 1"):
        shard_rows(batch, 0)


def test_the_sharded_sweep_equals_the_single_process_sweep(
    local_ray, planted, planted_data, tmp_path
):
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    single = ablation_sweep(bridge, batch, means, progress=False)
    out = tmp_path / "sweep.csv"
    merged = sharded_sweep(bridge, batch, means, out, shards=2)
    shape = (len(batch), bridge.cfg.n_layers, bridge.cfg.n_heads)
    torch.testing.assert_close(
        effects_tensor(merged, *shape), effects_tensor(single, *shape), atol=1e-5, rtol=0
    )
    assert list(merged.columns) == list(single.columns)
    assert merged["example_id"].tolist() == single["example_id"].tolist()
    shard_files = sorted(tmp_path.glob("sweep.shard-*-of-2.csv"))
    assert len(shard_files) == 2
    # the merged table is a finished sweep: a single-process rerun resumes it without sweeping
    resumed = ablation_sweep(bridge, batch, means, out, progress=False)
    torch.testing.assert_close(
        effects_tensor(resumed, *shape), effects_tensor(single, *shape), atol=1e-5, rtol=0
    )
    # and the shards resume their own tables
    again = sharded_sweep(bridge, batch, means, out, shards=2)
    torch.testing.assert_close(
        effects_tensor(again, *shape), effects_tensor(merged, *shape), atol=0, rtol=0
    )


def test_shards_compute_the_models_own_buffers_not_the_configs(local_ray):
    """The model travels to the Ray tasks with every tensor: a rotary buffer set by hand (not in
    the state dict, not what the config implies) is the shards' too."""
    from test_engine import task_batch

    from mistill_lens.lens.backends import means_from_events
    from mistill_lens.models.checkpoints import load_model

    model, tokenizer = load_model("checkpoints/base_students/llama")
    for name, buffer in model.original_model.named_buffers():
        if name.endswith("inv_freq"):
            buffer.mul_(1.7)
    batch = task_batch(tokenizer, n=2)
    means = means_from_events(model, batch)
    heads = [(0, 1), (1, 2), (3, 0)]
    single = ablation_sweep(model, batch, means, heads=heads, progress=False)  # full forward
    merged = sharded_sweep(model, batch, means, heads=heads, shards=2)
    shape = (len(batch), model.cfg.n_layers, model.cfg.n_heads)
    torch.testing.assert_close(
        effects_tensor(merged, *shape),
        effects_tensor(single, *shape),
        atol=1e-4,
        rtol=0,
        equal_nan=True,
    )
