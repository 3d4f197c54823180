"""Smoke runs of the benchmarks: they run, and their agreement figures hold (timings are printed
by `mistill-lens bench`, never asserted)."""

from mistill_lens.benchmarks import (
    attribution_benchmark,
    distill_step_benchmark,
    loglog_slope,
    long_context_benchmark,
    scaling_benchmark,
    sweep_benchmark,
)
from mistill_lens.models.checkpoints import load_model


def test_sweep_benchmark_smoke():
    model, tokenizer = load_model("checkpoints/base_students/llama")
    result = sweep_benchmark(model, tokenizer, k=13, n_examples=2, loop_heads=2, seed=0)
    assert result["max_abs_diff"] <= 1e-4
    assert result["heads"] == model.cfg.n_layers * model.cfg.n_heads
    assert result["loop_scaled_from_heads"] == 2 and result["events"] > 0
    assert result["engine_s"] > 0 and result["loop_s"] > 0


def test_scaling_benchmark_smoke():
    result = scaling_benchmark(ks=(13, 16), loop_max_k=13, seed=0)
    modes = [(p["mode"], p["k"]) for p in result["points"]]
    assert modes == [("engine", 13), ("engine", 16), ("loop", 13)]
    assert result["points"][1]["tokens"] > result["points"][0]["tokens"]
    assert result["engine_time_exponent"] is not None


def test_long_context_benchmark_smoke():
    result = long_context_benchmark(k=13, seed=0)
    assert result["tokens"] > 0 and 0 < result["decided_events"] <= result["events"]
    assert result["heads_swept"] == 16 and result["null_events"] == result["decided_events"]
    assert any("one example" in w for w in result["warnings"])


def test_loglog_slope_recovers_a_power_law():
    xs = [100, 200, 400, 800]
    assert loglog_slope(xs, [3 * x**2 for x in xs]) == 2.0
    assert loglog_slope(xs, [5 * x for x in xs]) == 1.0
    assert loglog_slope([100], [1]) is None


def test_attribution_benchmark_smoke():
    model, tokenizer = load_model("checkpoints/base_students/llama")
    result = attribution_benchmark(model, tokenizer, k=13, n_examples=2, seed=0)
    assert -1 <= result["rank_correlation"] <= 1
    assert result["forward_equivalents"] > 0 and result["events"] > 0


def test_distill_step_benchmark_smoke():
    result = distill_step_benchmark("llama", steps=2, batch_size=2, seed=0)
    assert result["time_ratio"] > 0 and result["memory_ratio"] > 0
    assert result["mistill"]["events_per_batch"] > 0  # the attention loss had events to supervise
