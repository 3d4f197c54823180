import json
import re

import pandas as pd
import pytest
import torch
from characterized import characterize_into
from planted import DECIDER, WITHIN, planted_examples

from mistill_lens.distill.evaluation import median_recovery
from mistill_lens.lens import plot
from mistill_lens.lens.calibration import Calibration
from mistill_lens.lens.outputs import characterization_figures, read_characterization
from mistill_lens.lens.plot import token_labels
from mistill_lens.lens.results import CharacterizeConfig, rank_correlation


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
        # self-contained: plotly.js inside, nothing loaded from beside the file or the network
        assert not re.findall(r"<script[^>]*src=", html)
        assert len(html) > 1_000_000
    assert not (tmp_path / "plotly.min.js").exists()
    assert len(figures["maps.html"].data) == 4  # raw and calibrated, per kind
    best = figures["early.html"].data[0]
    assert list(best.x) == [1, 2] and list(best.y) == [1.0, 0.8]  # the best stage per k
    # titled by the kind it reads (an own task's kind, not always the region)
    assert "answer decision" in plot.elicitation_figure(elicitation, "answer").layout.title.text


def test_head_maps_are_centred_share_one_scale_and_mark_circuit_and_unswept_heads(calibration):
    kinds = calibration.kinds
    circuits = {kinds[0]: [DECIDER]}
    swept = [h for h in all_heads_of(calibration) if h != (1, 3)]
    fig = plot.head_map_figure(calibration, circuits, z_min=3.0, swept=swept)
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert len(heatmaps) == 2 * len(kinds)
    # one colour axis for every raw panel, one for every z panel: a z is the same colour in any row
    assert {t.coloraxis for t in heatmaps[0::2]} == {"coloraxis"}
    assert {t.coloraxis for t in heatmaps[1::2]} == {"coloraxis2"}
    for axis in (fig.layout.coloraxis, fig.layout.coloraxis2):
        assert axis.cmin == -axis.cmax and axis.colorscale[0][1] != axis.colorscale[-1][1]
    z_max = float(calibration.z.abs().max())
    assert fig.layout.coloraxis2.cmax == pytest.approx(max(z_max, 3.0))
    assert "3 (threshold)" in fig.layout.coloraxis2.colorbar.ticktext
    # the unswept head is a gap on the grey background, not a zero effect
    assert all(t.z[1][3] is None for t in heatmaps) and fig.layout.plot_bgcolor == "#bdbdbd"
    assert heatmaps[0].z[0][0] is not None
    # the circuit head outlined by its cell's edges in both panels of its kind
    layer, head = DECIDER
    assert [(s.x0, s.x1, s.y0, s.y1) for s in fig.layout.shapes] == [
        (head - 0.5, head + 0.5, layer - 0.5, layer + 0.5)
    ] * 2
    n_layers, n_heads = calibration.null_mean.shape
    # layer 0 at the top, as imshow draws it; the axes span exactly the cells
    assert tuple(fig.layout.yaxis.range) == (n_layers - 0.5, -0.5)
    assert tuple(fig.layout.xaxis.range) == (-0.5, n_heads - 0.5)
    assert f"n={calibration.n_events[0]} events" in fig.layout.annotations[0].text


def test_a_30_layer_head_map_outlines_the_right_cell_in_a_browser(tmp_path):
    """Rendered by headless Chromium: the outline of L25H4 is centred on layer 25's tick, one
    layer high, and the outline of L29H8 ends where the plot area ends (no band below layer 29)."""
    from test_report import chromium

    torch.manual_seed(0)
    calibration = Calibration(
        ("region",), torch.randn(1, 30, 9), torch.randn(30, 9), torch.rand(30, 9) + 0.5, 1e-2
    )
    fig = plot.head_map_figure(calibration, {"region": [(25, 4), (29, 8)]}, z_min=3.0)
    page = tmp_path / "map.html"
    plot.write_figure(fig, page)
    dom = chromium(
        page, "--virtual-time-budget=5000", "--dump-dom", user_data=tmp_path / "profile"
    ).stdout
    svg = dom[dom.index('class="main-svg"') :]
    ticks = {
        int(label): float(y)
        for y, label in re.findall(
            r'<g class="ytick"><text[^>]*transform="translate\([\d.]+,([\d.]+)\)"[^>]*>(\d+)</text>',
            svg,
        )
    }
    boxes = [
        tuple(map(float, m))
        for m in re.findall(
            r'<path data-index="\d+"[^>]*d="M([\d.]+),([\d.]+)H([\d.]+)V([\d.]+)H', svg
        )
    ]
    assert len(boxes) == 4  # two heads, two panels
    cell = (ticks[25] - ticks[0]) / 25
    top, bottom = boxes[0][1], boxes[0][3]  # L25H4 in the raw panel
    assert (top + bottom) / 2 == pytest.approx(ticks[25], abs=0.5)
    assert bottom - top == pytest.approx(cell, abs=0.5)
    plot_bottom = max(
        float(y) + float(h)
        for y, h in re.findall(r'class="xgrid crisp"[^>]*d="M0,([\d.]+)v([\d.]+)"', svg)
    )
    assert boxes[1][3] == pytest.approx(plot_bottom, abs=0.5)  # L29H8's lower edge


def all_heads_of(calibration):
    n_layers, n_heads = calibration.null_mean.shape
    return [(l, h) for l in range(n_layers) for h in range(n_heads)]


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
    figures = ("head_maps", "ablation_curve", "attention_families", "elicitation")
    for name in (*figures, "example_margins", "example_attention"):
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
    # the engine checks itself on the first events it is asked about: with the means and margins
    # read back from the folder those are other events, so its check figures differ
    assert {k: v for k, v in again.items() if k != "backend"} == {
        k: v for k, v in summary.items() if k != "backend"
    }
    assert again["backend"]["check"]["passed"]
    # the folder reads back as the same characterisation
    read = read_characterization(tmp_path)
    assert read.summary() == again  # the folder holds the second run
    assert read.circuits == {"region": [DECIDER], "within": [WITHIN], "all": [DECIDER, WITHIN]}
    assert median_recovery(tmp_path, kind="within") == read.median_recovery("within")
    # a damaged summary is named with what is wrong, never a bare JSON or key error
    import shutil

    damaged = tmp_path.parent / "damaged"
    shutil.copytree(tmp_path, damaged)
    text = (damaged / "summary.json").read_text()
    (damaged / "summary.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"damaged/summary.json is not readable JSON"):
        read_characterization(damaged)
    (damaged / "summary.json").write_text('{"circuit": []}')
    with pytest.raises(ValueError, match=r"summary.json lacks \['config'"):
        read_characterization(damaged)
    # the token-labelled view: the chosen head's row is a distribution over the example's tokens
    # up to the query, and every margin is the one the sweep started from
    view = read.example
    assert view.head in read.circuits[view.example.events[view.event].kind]
    assert len(view.row) == view.query + 1 and sum(view.row) == pytest.approx(1.0, abs=1e-5)
    assert len(view.margins) == len(view.example.events) and view.margins[view.event] > 0
    clean = pd.read_csv(tmp_path / "sweep.csv").groupby("event_row").clean_margin.first()
    assert pytest.approx(view.margins[view.event], abs=1e-5) in list(clean)
    figure = characterization_figures(read)["example_attention"]
    assert list(figure.data[0].x) == token_labels(view.example)[: view.query + 1]
    # the most attended tokens named at staggered heights, the highest first
    named = [a for a in figure.layout.annotations if a.showarrow]
    assert len(named) == min(5, view.query + 1) and len({a.ay for a in named}) == len(named)
    assert named[0].text == max(zip(view.row, figure.data[0].x))[1]


def test_families_figure_shows_the_circuit_and_the_top_heads_per_family():
    heads = [(l, h) for l in range(30) for h in range(9)]
    families = pd.DataFrame(
        {
            "kind": ["near_miss"] * len(heads),
            "layer": [l for l, _ in heads],
            "head": [h for _, h in heads],
            "ratio_region_candidates": [float(i) for i in range(len(heads))],
            "ratio_near_miss_mention": [float(-i) for i in range(len(heads))],
        }
    )
    fig = plot.attention_families_figure(families, circuit=[(12, 4)], top=3)
    labels = list(fig.data[0].x)
    # the 3 largest of each family (the last heads, the first heads) and the circuit head
    assert len(labels) == 7 and "L12H4* (near_miss)" in labels
    assert "L29H8 (near_miss)" in labels and "L0H0 (near_miss)" in labels
