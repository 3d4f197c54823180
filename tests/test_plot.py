import json

import pandas as pd
import pytest
import torch
from characterized import characterize_into
from planted import DECIDER, WITHIN, planted_examples

from mistill_lens.distill.evaluation import median_recovery
from mistill_lens.lens import plot
from mistill_lens.lens.calibration import Calibration
from mistill_lens.lens.characterize import CharacterizeConfig, rank_correlation
from mistill_lens.lens.outputs import read_characterization


def test_figures_are_written_as_html_sharing_one_bundle(tmp_path):
    calibration = Calibration(
        ("region", "within"), torch.rand(2, 2, 3), torch.rand(2, 3), torch.rand(2, 3), 1e-2
    )
    curve = pd.DataFrame(
        {
            "order": ["by score", "random"] * 2,
            "n_ablated": [0, 0, 1, 1],
            "kind": "region",
            "fraction_kept": [1.0, 1.0, 0.2, 0.9],
        }
    )
    families = pd.DataFrame(
        {
            "kind": ["region"],
            "layer": [0],
            "head": [1],
            "ratio_region_candidates": [5.0],
            "ratio_near_miss_mention": [0.5],
        }
    )
    elicitation = pd.DataFrame(
        {
            "k": [1, 1, 2],
            "stage": [0, 1, 1],
            "stage_name": ["a", "b", "b"],
            "method": "probe",
            "accuracy": [0.3, 1.0, 0.8],
            "chance": 0.2,
        }
    )
    figures = {
        "maps.html": plot.head_map_figure(calibration),
        "curve.html": plot.ablation_curve_figure(curve),
        "families.html": plot.attention_families_figure(families),
        "early.html": plot.elicitation_figure(elicitation),
    }
    for name, figure in figures.items():
        written = plot.write_figure(figure, tmp_path / name)
        assert written[0] == tmp_path / name
        html = (tmp_path / name).read_text()
        assert 'src="plotly.min.js"' in html and len(html) < 200_000
    assert (tmp_path / "plotly.min.js").stat().st_size > 1_000_000
    assert len(figures["maps.html"].data) == 4  # raw and calibrated, per kind
    best = figures["early.html"].data[0]
    assert list(best.x) == [1, 2] and list(best.y) == [1.0, 0.8]  # the best stage per k


def test_rank_correlation():
    assert rank_correlation(
        torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 35.0])
    ) == pytest.approx(1.0)
    assert rank_correlation(
        torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])
    ) == pytest.approx(-1.0)


def test_characterize_end_to_end_on_the_planted_model(planted, tmp_path):
    bridge, tokenizer = planted
    config = CharacterizeConfig(seed=0, ks=(1, 2, 3), progress=False, elicitation_kind="region")

    def mention(example, event):
        return event.chosen if event.kind == "region" else None

    summary = characterize_into(
        tmp_path,
        bridge,
        tokenizer,
        planted_examples(20, seed=0),
        planted_examples(40, seed=1),
        config,
        near_miss_text=mention,
    )
    assert summary["circuit_size"] == 2 and summary["circuit"] == [list(DECIDER), list(WITHIN)]
    assert summary["n_heads_total"] == 8
    assert (
        summary["top_heads"]["region"][0]["layer"] == DECIDER[0]
        and summary["top_heads"]["region"][0]["head"] == DECIDER[1]
    )
    assert summary["within"]["sufficiency"] == pytest.approx(1.0, abs=1e-4)
    assert summary["within"]["knock_in"] == pytest.approx(1.0, abs=1e-4)
    assert summary["region"]["knock_in"] == pytest.approx(1 / 3, abs=1e-4)
    assert summary["within"]["coverage"] == {
        "necessity": pytest.approx(summary["within"]["coverage"]["necessity"]),
        "sufficiency": 1.0,
        "knock_in": 1.0,
    }
    # attribution is exact on this linear model; the rank correlation is below 1 only through ties
    # among the many zero-effect heads, ordered by float noise
    attribution = pd.read_csv(tmp_path / "attribution.csv")
    assert (attribution.attribution - attribution.exact).abs().max() < 1e-4
    assert summary["attribution_vs_ablation_spearman"]["all"] > 0.5
    assert summary["families"]["L0H0/region"] == "region_candidates"
    assert summary["elicitation"]["lead"] == {"probe": 2, "logit_lens": 2}
    heads = json.loads((tmp_path / "heads.json").read_text())
    assert [(h["layer"], h["head"]) for h in heads["region"]] == [DECIDER]
    assert heads["region"][0]["z"] > 50 and "null_std" in heads["region"][0]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["circuit_size"] == 2 and set(on_disk["region"]) >= {
        "necessity",
        "sufficiency",
        "knock_in",
        "coverage",
    }
    sweep = pd.read_csv(tmp_path / "sweep.csv")
    assert len(sweep) == 8 * summary["n_decided_events"]
    for name in ("head_maps", "ablation_curve", "attention_families", "elicitation"):
        assert (tmp_path / "figures" / f"{name}.html").exists()
    # deterministic, and the sweeps resume from the files already written
    again = characterize_into(
        tmp_path,
        bridge,
        tokenizer,
        planted_examples(20, seed=0),
        planted_examples(40, seed=1),
        config,
        near_miss_text=mention,
    )
    assert again == summary
    # the folder reads back as the same characterisation
    read = read_characterization(tmp_path)
    assert read.summary() == summary
    assert read.circuits == {"region": [DECIDER], "within": [WITHIN], "all": [DECIDER, WITHIN]}
    assert median_recovery(tmp_path, kind="within") == read.median_recovery("within")
