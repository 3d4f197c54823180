import pytest
import torch
from planted import DECIDER, GENERIC, GENERIC_GAIN, WITHIN

from mistill_lens.lens.calibration import calibrate, null_events


def test_null_events_are_matched_non_decisions_with_shuffled_contrasts(planted_data):
    examples, batch = planted_data["examples"], planted_data["batch"]
    nulls = null_events(examples, batch.events, per_event=2, seed=0)
    assert len(nulls) == 2 * len(batch)
    by_id = {x.example_id: x for x in examples}
    for null in nulls:
        example = by_id[null.example_id]
        assert null.kind == "null"
        assert null.position >= example.prompt_tokens
        assert null.position not in {e.position for e in example.events}
        assert null.chosen_token == example.tokens[null.position]
        assert null.contrast_tokens[0] != null.chosen_token
    assert {n.contrast_tokens[0] for n in nulls} <= {
        n.chosen_token for n in nulls
    }  # contrasts are shuffled choices
    assert nulls == null_events(examples, batch.events, per_event=2, seed=0)
    assert nulls != null_events(examples, batch.events, per_event=2, seed=1)


def test_raw_scores_favour_the_generic_head_calibrated_scores_the_decider(calibration):
    region = calibration.kind_index("region")
    raw, z = calibration.raw[region], calibration.z[region]
    assert raw[GENERIC].item() == pytest.approx(GENERIC_GAIN, abs=0.1)
    assert raw[GENERIC] > raw[DECIDER] > 1.0  # uncalibrated, the generic head looks most important
    assert z[DECIDER] > 50 and z[DECIDER] == z.max()
    assert abs(z[GENERIC]) < 2  # within its null distribution: discounted
    within = calibration.kind_index("within")
    assert (
        calibration.z[within][WITHIN] == calibration.z[within].max()
        and calibration.z[within][WITHIN] > 50
    )


def test_calibration_is_inspectable(calibration):
    # the generic head moves null margins as much as real ones; the decider never does
    assert calibration.null_mean[GENERIC] > 1.0 and calibration.null_std[GENERIC] > 1.0
    assert calibration.null_mean[DECIDER].abs() < 1e-4 and calibration.null_std[DECIDER] < 1e-4
    frame = calibration.to_frame()
    assert set(frame.columns) == {
        "kind",
        "layer",
        "head",
        "raw",
        "null_mean",
        "null_std",
        "above_null",
        "z",
    }
    assert len(frame) == 2 * 2 * 4
    row = frame[
        (frame.kind == "region") & (frame.layer == GENERIC[0]) & (frame["head"] == GENERIC[1])
    ].iloc[0]
    assert row.above_null == pytest.approx(row.raw - row.null_mean)


def test_calibrate_rejects_bad_input():
    effects = torch.zeros(4, 2, 3)
    with pytest.raises(ValueError, match="kinds"):
        calibrate(effects, ["region"] * 3, effects)
    with pytest.raises(ValueError, match="two null"):
        calibrate(effects, ["region"] * 4, effects[:1])
    with pytest.raises(ValueError, match="head grids"):
        calibrate(effects, ["region"] * 4, torch.zeros(4, 3, 3))
    bad = effects.clone()
    bad[0, 0, 0] = torch.nan
    with pytest.raises(FloatingPointError):
        calibrate(bad, ["region"] * 4, effects)
