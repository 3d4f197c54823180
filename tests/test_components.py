"""Layer outputs' shares of the margin, on the planted model: its MLPs are zero (no share), its
layer-0 attention carries the decisions, its layer 1 nothing; the engine equals the full forward."""

import pytest

from mistill_lens.lens.components import component_shares
from mistill_lens.lens.engine import InterventionEngine


def test_the_planted_decisions_live_in_layer_0_attention_not_in_mlps(planted, planted_data):
    bridge, _ = planted
    batch, reference = planted_data["batch"], planted_data["reference_batch"]
    reference = reference.select([k != "null" for k in reference.kinds])
    engine = InterventionEngine(bridge)
    mlp = component_shares(engine, batch, reference, "hook_mlp_out")
    assert mlp[["single", "cumulative"]].abs().max().max() < 1e-5  # zero MLPs carry nothing
    attention = component_shares(engine, batch, reference, "hook_attn_out")
    layer0 = attention[attention.layer == 0].set_index("kind")
    assert (layer0.single > 0.8).all(), layer0
    layer1 = attention[attention.layer == 1].set_index("kind")
    assert layer1.single.abs().max() < 1e-5
    assert (layer1.cumulative - layer0.single).abs().max() < 1e-5
    full = component_shares(bridge, batch, reference, "hook_attn_out")
    assert full.single.tolist() == pytest.approx(attention.single.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="site must be one of"):
        component_shares(engine, batch, reference, "hook_resid_mid")


def test_characterize_records_the_shares_in_its_summary_and_figure(planted, tmp_path):
    from characterized import characterize_into
    from planted import planted_examples

    from mistill_lens.lens.outputs import read_characterization
    from mistill_lens.lens.results import CharacterizeConfig

    bridge, tokenizer = planted
    config = CharacterizeConfig(seed=0, ks=(1, 2), progress=False, components=True)
    summary = characterize_into(
        tmp_path / "run",
        bridge,
        tokenizer,
        planted_examples(12, seed=0),
        planted_examples(30, seed=1),
        config,
    )
    components = summary["components"]
    assert set(components) == {"hook_mlp_out", "hook_attn_out"}
    for kind, shares in components["hook_attn_out"].items():
        assert shares["all_layers"] > 0.8 and shares["top"][0][0] == 0  # layer 0 decides
        assert len(shares["single"]) == len(shares["cumulative"]) == bridge.cfg.n_layers
        assert abs(components["hook_mlp_out"][kind]["all_layers"]) < 1e-5
    assert read_characterization(tmp_path / "run").components == components
    assert (tmp_path / "run" / "figures" / "components.html").is_file()
