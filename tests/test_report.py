"""The HTML report: one file that opens alone, offline, in a real headless Chromium, with its plots
drawn (checked on a screenshot and in the rendered DOM)."""

import shutil
import subprocess

import pytest
from characterized import characterize_into
from PIL import Image
from planted import DECIDER, planted_examples

from mistill_lens import cli
from mistill_lens.lens.characterize import CharacterizeConfig
from mistill_lens.report import write_report

CHROMIUM = shutil.which("chromium")
# as root, closed network: no sandbox, no background connections (they are refused here)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium(page, *args, user_data):
    if CHROMIUM is None:
        pytest.fail("Debian's chromium is not installed: `make install` installs it")
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={user_data}", *args, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


@pytest.fixture(scope="module")
def characterised(planted, tmp_path_factory):
    bridge, tokenizer = planted
    out = tmp_path_factory.mktemp("char") / "char"
    config = CharacterizeConfig(seed=0, ks=(1, 2, 3), progress=False, elicitation_kind="region")
    characterize_into(
        out,
        bridge,
        tokenizer,
        planted_examples(20, seed=0),
        planted_examples(40, seed=1),
        config,
        near_miss_text=lambda example, event: event.chosen if event.kind == "region" else None,
        provenance={"command": "mistill-lens characterize --seed 0 (planted model)"},
    )
    return out


def test_the_report_opens_alone_offline_and_its_plots_render(characterised, tmp_path):
    path = write_report([characterised], tmp_path / "report")
    alone = tmp_path / "elsewhere" / "report.html"  # copied with no other file beside it
    alone.parent.mkdir()
    shutil.copy(path, alone)
    page = alone.read_text()
    assert (
        f"L{DECIDER[0]}H{DECIDER[1]}" in page
        and "(planted model)" in page
        and "decided events" in page
    )
    # the per-kind numbers say whose they are, and a fraction above 1 is explained
    assert "necessity of the global circuit" in page and "above 1 is not an error" in page

    dom = chromium(alone, "--dump-dom", user_data=tmp_path / "profile-dom").stdout
    # plotly drew every figure: two main SVG layers each (head maps, curve, families, elicitation,
    # and the example's token-labelled margins and attention row)
    assert dom.count('class="main-svg"') >= 2 * 6
    assert "0:" in dom and "margin (logits)" in dom  # the token axis labels and the margin axis

    shot = tmp_path / "shot.png"
    chromium(
        alone, f"--screenshot={shot}", "--window-size=1200,2200", user_data=tmp_path / "profile"
    )
    pixels = Image.open(shot).convert("RGB").getdata()
    # the deciding head's strong positive z is drawn in the diverging scale's dark red
    red = sum(1 for r, g, b in pixels if r > 120 and g < 60 and b < 60)
    blue = sum(1 for r, g, b in pixels if b > 120 and r < 80 and g < 140)
    assert red > 200, f"{red} dark red pixels: the head maps did not render"
    assert blue > 50, f"{blue} blue pixels: the colour bars or curves did not render"


def test_report_command_refuses_what_is_not_a_run(characterised, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "--runs", str(tmp_path), "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    assert "neither a finished characterisation" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # nothing written for bad input
    cli.main(["report", "--runs", str(characterised), "--out", str(tmp_path / "ok")])
    assert (tmp_path / "ok" / "index.html").is_file()
