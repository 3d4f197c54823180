"""Nothing lost, nothing silent: output folders, fingerprinted resumes, degenerate options, clear errors.

Every test here can fail: a user's file that a command deletes, a stale table that is resumed, a
degenerate option that is accepted, or a bad input that passes silently all break an assertion.
"""

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pandas as pd
import pytest
import torch
from characterized import characterize_into
from planted import VOCAB, planted_examples
from test_train import TINY
from transformers import GPT2Config, GPT2LMHeadModel

from mistill_lens import cli, task
from mistill_lens.lens.backends import FullForward
from mistill_lens.lens.characterize import CharacterizeConfig
from mistill_lens.lens.events import make_event_batch, position_class_names
from mistill_lens.lens.fingerprint import StaleResultError, StaleResultWarning, resumable
from mistill_lens.lens.hooks import (
    ablate_all_but_hooks,
    all_heads,
    compute_head_means,
    event_position_classes,
    gather_at_positions,
    knock_in_hooks,
    mean_ablation_hooks,
    validate_heads,
)
from mistill_lens.lens.margins import attribution_scores, margins_at, run_margins
from mistill_lens.lens.sweep import ablation_sweep
from mistill_lens.models.checkpoints import (
    load_hf_model,
    save_checkpoint,
    teacher_config,
    to_bridge,
)
from mistill_lens.models.tokenizers import teacher_tokenizer
from mistill_lens.runs import (
    COMMIT_FILE,
    MARKER_FILE,
    STAGING_DIR,
    OutputError,
    claim_run_dir,
    commit_staged,
    finish_interrupted_commit,
    staging_dir,
)
from mistill_lens.training.config import TrainConfig
from mistill_lens.training.loop import train

USER_TEXT = "my notes: do not delete\n"
TINY_TRAIN = [
    "--universe-size",
    "300",
    "--k",
    "8",
    "--max-mentions",
    "1",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--batch-size",
    "2",
    "--no-progress",
]


def run_cli(capsys, *argv):
    """(exit code, stderr) of the command line run in this process."""
    try:
        cli.main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def user_folder(tmp_path, name="mine"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "notes.txt").write_text(USER_TEXT)
    return folder


# --- data loss ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--steps", "2", *TINY_TRAIN],
        [
            "distill",
            "--student",
            "llama",
            "--objective",
            "cot",
            "--steps",
            "1",
            "--n-eval",
            "0",
            "--no-progress",
        ],
        ["characterize", "--n", "2", "--no-progress"],
        ["build-tokenizers"],
        ["distill-report", "--runs", "nowhere"],
    ],
)
def test_a_users_folder_survives_every_command(tmp_path, capsys, argv):
    folder = user_folder(tmp_path)
    code, err = run_cli(capsys, *argv, "--out", str(folder))
    assert code == 2
    assert f"output folder {folder} is not empty" in err and "notes.txt" in err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == USER_TEXT


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--steps", "2", *TINY_TRAIN],
        ["characterize", "--n", "2", "--no-progress"],
        ["build-tokenizers"],
    ],
)
def test_an_existing_file_given_as_output_folder_is_refused_and_kept(tmp_path, capsys, argv):
    target = tmp_path / "results.txt"
    target.write_text(USER_TEXT)
    code, err = run_cli(capsys, *argv, "--out", str(target))
    assert code == 2 and "is an existing file" in err and "Traceback" not in err
    assert target.read_text() == USER_TEXT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]


def test_data_and_save_outputs_never_overwrite(tmp_path, capsys):
    target = tmp_path / "examples.jsonl"
    target.write_text(USER_TEXT)
    code, err = run_cli(capsys, "data", "--n", "1", "--out", str(target))
    assert code == 2 and "already exists" in err and target.read_text() == USER_TEXT
    code, err = run_cli(capsys, "data", "--n", "1", "--out", str(tmp_path))
    assert code == 2 and "is a folder" in err
    code, err = run_cli(
        capsys, "evaluate", "--n", "1", "--save-outputs", str(target), "--no-progress"
    )
    assert code == 2 and "already exists" in err and target.read_text() == USER_TEXT


def test_build_tokenizers_requires_an_output_folder(capsys):
    code, err = run_cli(capsys, "build-tokenizers")
    assert code == 2 and "--out" in err


def test_a_run_folder_keeps_the_users_file_across_checkpoints_and_resumes(tmp_path):
    config = replace(TINY, steps=2, checkpoint_every=1)
    out = tmp_path / "run"
    train(config, out, progress=False)
    (out / "notes.txt").write_text(USER_TEXT)
    with pytest.raises(Exception, match="different configuration"):
        train(replace(config, steps=3), out, progress=False)
    tokenizer = teacher_tokenizer()
    model, _ = load_hf_model(out)
    save_checkpoint(model, tokenizer, out, {"step": 9})
    assert (out / "notes.txt").read_text() == USER_TEXT
    assert json.loads((out / MARKER_FILE).read_text())["kind"] == "train"


def test_another_commands_run_folder_is_refused(tmp_path):
    claim_run_dir(tmp_path / "run", "characterize")
    with pytest.raises(OutputError, match="holds a `characterize` run, not a `train` run"):
        claim_run_dir(tmp_path / "run", "train")


def test_an_interrupted_commit_is_rolled_forward_or_discarded(tmp_path):
    run = claim_run_dir(tmp_path / "run", "train")
    (run / "weights.bin").write_text("old")
    (run / "notes.txt").write_text(USER_TEXT)
    # crash before the commit point: the staged files are discarded, the old ones stay
    (staging_dir(run) / "weights.bin").write_text("half-written")
    finish_interrupted_commit(run)
    assert (run / "weights.bin").read_text() == "old" and not (run / STAGING_DIR).exists()
    # crash after the commit point, before every file moved: the next use completes it
    staged = staging_dir(run)
    (staged / "weights.bin").write_text("new")
    (staged / "state.bin").write_text("new state")
    (staged / COMMIT_FILE).write_text(json.dumps(["weights.bin", "state.bin"]))
    finish_interrupted_commit(run)
    assert (run / "weights.bin").read_text() == "new" and (
        run / "state.bin"
    ).read_text() == "new state"
    assert (run / "notes.txt").read_text() == USER_TEXT and not (run / STAGING_DIR).exists()
    staged = staging_dir(run)
    (staged / "weights.bin").write_text("newer")
    assert commit_staged(run) == ["weights.bin"] and (run / "weights.bin").read_text() == "newer"


# --- stale results -----------------------------------------------------------------------------


def test_one_rule_decides_whether_a_stored_result_is_resumed():
    current = {"format": "1", "model": "aa", "events": "bb"}
    assert resumable(dict(current), current, "table t", "error")
    assert resumable(dict(current), current, "table t", "recompute")
    other = {**current, "events": "cc", "model": "dd"}
    with pytest.raises(StaleResultError, match=r"table t .*events, model differ.*; fix it"):
        resumable(other, current, "table t", "error", remedy="fix it")
    with pytest.warns(StaleResultWarning, match="events, model differ.*: recomputed"):
        assert not resumable(other, current, "table t", "recompute")
    with pytest.raises(StaleResultError, match="no fingerprint"):
        resumable(None, current, "table t", "error")
    with pytest.raises(ValueError, match="stale must be 'error' or 'recompute', got 'keep'"):
        resumable(dict(current), current, "table t", "keep")


def test_a_sweep_table_with_other_columns_is_refused(planted, planted_data, tmp_path):
    bridge, _ = planted
    path = tmp_path / "sweep.csv"
    ablation_sweep(
        bridge, planted_data["batch"], planted_data["means"], path, heads=[(0, 0)], progress=False
    )
    table = pd.read_csv(path).rename(columns={"effect": "delta"})
    table.to_csv(path, index=False)
    with pytest.raises(StaleResultError, match="has columns .*delta"):
        ablation_sweep(bridge, planted_data["batch"], planted_data["means"], path, progress=False)


def test_a_sweep_from_other_means_is_never_resumed(planted, planted_data, tmp_path):
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    path = tmp_path / "sweep.csv"
    ablation_sweep(bridge, batch, means, path, heads=[(0, 0), (0, 1)], progress=False)
    other_means = replace(means, means=means.means * 0.5)
    with pytest.raises(StaleResultError, match="reference means differ"):
        ablation_sweep(bridge, batch, other_means, path, progress=False)
    with pytest.warns(UserWarning, match="reference means differ"):
        recomputed = ablation_sweep(
            bridge, batch, other_means, path, progress=False, stale="recompute"
        )
    fresh = ablation_sweep(bridge, batch, other_means, tmp_path / "fresh.csv", progress=False)
    pd.testing.assert_frame_equal(recomputed, fresh)
    # and the table on disk is the recomputed one, not a mix
    pd.testing.assert_frame_equal(
        pd.read_csv(path).sort_values(["layer", "head", "event_row"], ignore_index=True), fresh
    )


def test_a_sweep_table_without_a_fingerprint_is_not_trusted(planted, planted_data, tmp_path):
    bridge, _ = planted
    path = tmp_path / "sweep.csv"
    table = ablation_sweep(
        bridge, planted_data["batch"], planted_data["means"], path, heads=[(0, 0)], progress=False
    )
    (tmp_path / "sweep.csv.fingerprint.json").unlink()  # as an older version left it
    table.to_csv(path, index=False)
    with pytest.raises(StaleResultError, match="no fingerprint"):
        ablation_sweep(bridge, planted_data["batch"], planted_data["means"], path, progress=False)


def test_rerunning_characterize_with_other_reference_examples_refuses_or_recomputes(
    planted, tmp_path
):
    bridge, tokenizer = planted
    config = CharacterizeConfig(seed=0, progress=False, curve_points=2)
    examples, reference = planted_examples(12, seed=0), planted_examples(30, seed=1)
    characterize_into(tmp_path / "run", bridge, tokenizer, examples, reference, config)
    other_reference = planted_examples(30, seed=5)
    with pytest.raises(StaleResultError, match="reference means"):
        characterize_into(tmp_path / "run", bridge, tokenizer, examples, other_reference, config)
    redone = characterize_into(
        tmp_path / "run",
        bridge,
        tokenizer,
        examples,
        other_reference,
        replace(config, stale="recompute"),
    )
    fresh = characterize_into(
        tmp_path / "fresh", bridge, tokenizer, examples, other_reference, config
    )
    assert any("recomputed" in w for w in redone["warnings"])
    assert pd.read_csv(tmp_path / "run" / "sweep.csv").equals(
        pd.read_csv(tmp_path / "fresh" / "sweep.csv")
    )
    same = lambda summary: {k: v for k, v in summary.items() if k not in ("warnings", "config")}  # noqa: E731
    assert same(redone) == same(fresh)


def test_a_training_state_from_other_initial_weights_is_not_resumed(tmp_path):
    base = replace(TINY, steps=1)
    train(base, tmp_path / "a", progress=False)
    train(replace(base, seed=4), tmp_path / "b", progress=False)
    config = replace(base, steps=2, init_from=str(tmp_path / "init"))
    (tmp_path / "init").mkdir()
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "mistill.json",
    ):
        (tmp_path / "init" / name).write_bytes((tmp_path / "a" / name).read_bytes())
    train(config, tmp_path / "more", progress=False)
    (tmp_path / "init" / "model.safetensors").write_bytes(
        (tmp_path / "b" / "model.safetensors").read_bytes()
    )
    with pytest.raises(Exception, match="init weights differ"):
        train(replace(config, steps=3), tmp_path / "more", progress=False)


def test_a_checkpoint_edited_after_it_was_written_is_not_resumed(tmp_path):
    config = replace(TINY, steps=1)
    train(config, tmp_path / "run", progress=False)
    weights = tmp_path / "run" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    with pytest.raises(OutputError, match="model.safetensors missing or changed"):
        train(replace(config, steps=2), tmp_path / "run", progress=False)


def test_a_truncated_traces_cache_is_detected_and_redone(tmp_path):
    from mistill_lens.distill.data import teacher_traces

    task_config = {"universe_size": 300, "k": 4, "max_mentions": 1}
    first, tried = teacher_traces("tiny", 8, 0, "train", task_config, tmp_path, progress=False)
    assert tried == 8 and len(first) >= 2
    (path,) = tmp_path.glob("verbatim-*.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:1]))  # part of the cache, each line intact
    with pytest.warns(UserWarning, match="lines, sha256 differ"):
        again, _ = teacher_traces("tiny", 8, 0, "train", task_config, tmp_path, progress=False)
    assert [e.to_json() for e in again] == [e.to_json() for e in first]
    assert len(task.read_jsonl(path)) == len(first)


# --- degenerate runs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["evaluate", "--n", "0"], "argument --n: value must be at least 1, got 0"),
        (
            ["distill", "--student", "llama", "--objective", "cot", "--out", "x", "--steps", "0"],
            "at least 1, got 0",
        ),
        (
            ["distill", "--student", "llama", "--objective", "cot", "--out", "x", "--steps", "-5"],
            "at least 1, got -5",
        ),
        (["characterize", "--n", "0", "--out", "x"], "argument --n: value must be at least 1"),
        (
            ["train", "--out", "x", "--seed", "-1"],
            "argument --seed: value must be between 0 and 2147483647",
        ),
        (["data", "--n", "2", "--out", "x.jsonl", "--max-mentions", "1", "--k", "1"], "use K >= 4"),
        (["data", "--n", "2", "--out", "x.jsonl", "--max-mentions", "2", "--k", "4"], "use K >= 7"),
        (
            ["train", "--role", "student", "--out", "x"],
            "mistill-lens train: error: --role student needs --student",
        ),
        (  # the default K's examples do not fit a from-scratch GPT-2's learned positions
            ["train", "--role", "teacher", "--out", "x", "--steps", "1", "--no-progress"],
            "exceeds the model's 1024 positions (K = 64",
        ),
        (
            [
                "distill",
                "--teacher",
                "/nowhere",
                "--student",
                "llama",
                "--objective",
                "cot",
                "--out",
                "x",
            ],
            "teacher folder /nowhere does not exist",
        ),
    ],
)
def test_degenerate_options_are_refused_with_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(capsys, *argv)
    assert code == 2 and message in err, err
    assert list(tmp_path.iterdir()) == [], "nothing is written when a command is refused"


def test_the_suggested_k_works():
    for max_mentions in (1, 2, 4):
        examples = task.generate_examples(
            30, 0, "train", k=task.min_k(max_mentions), max_mentions=max_mentions
        )
        assert len(examples) == 30


def _tiny_teacher_run():
    from mistill_lens.distill.training import DistillConfig

    return DistillConfig(
        family="llama",
        objective="mistill",
        seed=0,
        steps=4,
        batch_size=1,
        lr=1e-3,
        warmup_steps=1,
        n_layer=2,
        n_head=2,
        n_embd=32,
        checkpoint_every=4,
    )


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory):
    tokenizer = teacher_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        teacher_config(len(tokenizer), n_layer=2, n_head=2, n_embd=32, n_positions=1024)
    ).eval()
    return to_bridge(model, tokenizer), tokenizer


def test_mistill_without_teacher_events_is_refused_and_eventless_batches_log_no_attention_loss(
    tiny_teacher, tmp_path
):
    from mistill_lens.distill.training import distill

    bridge, tokenizer = tiny_teacher
    examples = task.generate_examples(2, 0, "train", universe_size=300, k=4, max_mentions=1)
    no_events = [replace(e, events=()) for e in examples]
    heads = {"region": [(1, 0)], "within": [(1, 0)], "near_miss": [(1, 1)]}
    with pytest.raises(ValueError, match="hold no teacher decision event.*exactly the CoT run"):
        distill(
            _tiny_teacher_run(),
            bridge,
            tokenizer,
            no_events,
            heads,
            tmp_path / "none",
            progress=False,
        )
    mixed = [examples[0], no_events[1]]
    metadata = distill(
        _tiny_teacher_run(), bridge, tokenizer, mixed, heads, tmp_path / "mixed", progress=False
    )
    log = torch.load(tmp_path / "mixed" / "training_state.pt", weights_only=False)["log"][
        "attention"
    ]
    assert None in log and any(v is not None for v in log)
    logged = [v for v in log if v is not None]
    assert metadata["final_attention_loss"] == logged[-1]
    assert metadata["attention_loss_tail"] == pytest.approx(
        logged[-1]
    )  # 4 steps: the tail is one value
    assert any("most batches hold none" in w for w in metadata["warnings"])


def test_each_minimum_count_warns_below_it_and_not_at_it(planted):
    from mistill_lens.lens.characterize import characterize

    bridge, tokenizer = planted
    examples, reference = planted_examples(12, seed=0), planted_examples(20, seed=1)
    base = CharacterizeConfig(seed=0, progress=False, curve_points=2, elicitation_kind="region")
    found = characterize(bridge, tokenizer, examples, reference, base)
    counts = {
        "min_events_per_kind": min(found.measures()[k]["n_events"] for k in found.kinds),
        "min_null_events": found.n_null_events,
        "min_elicitation_examples": found.elicitation["n_examples"],
    }
    phrases = {
        "min_events_per_kind": "events (fewer than",
        "min_null_events": "null events (fewer than",
        "min_elicitation_examples": "early elicitation rests on",
    }
    for option, count in counts.items():
        at = characterize(bridge, tokenizer, examples, reference, replace(base, **{option: count}))
        above = replace(base, **{option: count + 1})
        below = characterize(bridge, tokenizer, examples, reference, above)

        def fired(result):
            return [w for w in result.warnings if phrases[option] in w and str(count + 1) in w]

        assert not fired(at), (option, at.warnings)
        assert fired(below), (option, below.warnings)


def test_characterize_records_its_warnings_and_refuses_no_examples(planted, tmp_path):
    bridge, tokenizer = planted
    config = CharacterizeConfig(seed=0, progress=False, curve_points=2, elicitation_kind="region")
    summary = characterize_into(
        tmp_path / "few",
        bridge,
        tokenizer,
        planted_examples(3, seed=0),
        planted_examples(20, seed=1),
        config,
    )
    assert any("only 3 decided region events" in w for w in summary["warnings"])
    assert any("early elicitation skipped" in w for w in summary["warnings"])
    assert (
        json.loads((tmp_path / "few" / "summary.json").read_text())["warnings"]
        == summary["warnings"]
    )
    assert not (tmp_path / "few" / "elicitation.csv").exists()
    # and on every figure, which may be read without the summary
    head_maps = (tmp_path / "few" / "figures" / "head_maps.html").read_text()
    assert "warning: only 3 decided region events" in head_maps
    with pytest.raises(ValueError, match="no examples to characterise"):
        characterize_into(
            tmp_path / "none", bridge, tokenizer, [], planted_examples(20, seed=1), config
        )
    for option in ({"null_per_event": 0}, {"seed": -1}, {"sweep_top": 0}):
        with pytest.raises(ValueError, match="must be"):
            CharacterizeConfig(**option)
    for option in ({"steps": 0}, {"batch_size": 0}, {"lr": 0.0}, {"seed": 2**31}):
        with pytest.raises(ValueError, match="must be"):
            TrainConfig(**option)


# --- library inputs ----------------------------------------------------------------------------


def test_attribution_works_in_bf16_and_agrees_with_float32(planted, planted_data):
    _, tokenizer = planted
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(VOCAB), n_positions=32, n_embd=32, n_layer=2, n_head=4)
    weights = GPT2LMHeadModel(config).eval().state_dict()
    bridges = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = GPT2LMHeadModel(config).eval()
        model.load_state_dict(weights)
        bridges[dtype] = to_bridge(model.to(dtype), tokenizer, dtype=dtype)
    batch, reference = planted_data["batch"], planted_data["reference_batch"]
    scores = {}
    for dtype, bridge in bridges.items():
        means = compute_head_means(
            bridge,
            reference.tokens,
            event_position_classes(reference),
            position_class_names(reference.kinds),
        )
        assert means.means.dtype == torch.float32  # the mixed case that used to crash
        scores[dtype] = attribution_scores(bridge, batch, means)
        assert scores[dtype].dtype == torch.float32 and torch.isfinite(scores[dtype]).all()
    flat32, flat16 = scores[torch.float32].flatten(), scores[torch.bfloat16].flatten()
    assert torch.corrcoef(torch.stack([flat32, flat16]))[0, 1] > 0.95


def test_select_takes_a_boolean_mask(planted_data):
    batch = planted_data["batch"]
    mask = [kind == "within" for kind in batch.kinds]
    picked = batch.select(mask)
    assert picked.kinds == ["within"] * sum(mask) and len(picked) == sum(mask) != 2
    assert picked.events == batch.of_kind("within").events
    with pytest.raises(ValueError, match="boolean row mask"):
        batch.select(mask[:-1])
    with pytest.raises(TypeError, match="integer indices or a boolean mask"):
        batch.select(torch.tensor([0.0, 1.0]))


def test_negative_positions_are_errors_not_wrapped(planted, planted_data):
    bridge, _ = planted
    z = torch.zeros(2, 3, 10, 4, 32)
    with pytest.raises(IndexError, match="negative positions are not counted from the end"):
        gather_at_positions(z, torch.tensor([0, 1]), torch.tensor([2, -1]))
    with pytest.raises(IndexError, match="negative positions"):
        knock_in_hooks(bridge, [(0, 0)], torch.zeros(2, 2, 4, 32), torch.tensor([3, -2]))


def test_an_event_without_a_contrast_is_an_error_not_an_infinite_margin(planted_data):
    examples = planted_data["examples"]
    event = examples[0].events[0]
    with pytest.raises(ValueError, match="has no contrast token"):
        make_event_batch(examples, [replace(event, contrast_tokens=())])
    logits = torch.zeros(1, 3, 5)
    with pytest.raises(ValueError, match="no contrast token"):
        margins_at(logits, torch.tensor([1]), torch.tensor([2]), torch.tensor([[-1]]))


def test_non_integer_heads_are_errors_not_truncated(planted):
    bridge, _ = planted
    with pytest.raises(TypeError, match="must be an integer, got 0.7"):
        validate_heads(bridge, [(0.7, 1.9)])
    with pytest.raises(TypeError, match="head index must be an integer"):
        validate_heads(bridge, [(0, True)])
    assert validate_heads(bridge, [(torch.tensor(1), 2)]) == [(1, 2)]


def test_keeping_no_head_ablates_every_head(planted, planted_data):
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    classes = event_position_classes(batch, means.class_names)
    kept_nothing = run_margins(bridge, batch, ablate_all_but_hooks(bridge, [], means, classes))
    every = run_margins(
        bridge, batch, mean_ablation_hooks(bridge, all_heads(bridge), means, classes)
    )
    torch.testing.assert_close(kept_nothing, every, rtol=0, atol=0)
    assert not torch.allclose(kept_nothing, run_margins(bridge, batch))


# --- errors a person can act on ----------------------------------------------------------------


def test_broken_jsonl_lines_name_the_file_and_line(tmp_path):
    path = tmp_path / "examples.jsonl"
    rows = [
        e.to_json()
        for e in task.generate_examples(4, 0, "train", universe_size=300, k=8, max_mentions=1)
    ]
    lines = [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines[:3] + [lines[3][:-40]]) + "\n")
    with pytest.raises(ValueError, match=f"{path}, line 4: not valid JSON"):
        task.read_jsonl(path)
    del rows[2]["events"]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match=f"{path}, line 3: missing field 'events'"):
        task.read_jsonl(path)


def test_two_bridges_can_share_one_tokenizer():
    tokenizer = teacher_tokenizer()
    torch.manual_seed(0)
    config = teacher_config(len(tokenizer), n_layer=1, n_head=2, n_embd=32, n_positions=64)
    first = to_bridge(GPT2LMHeadModel(config).eval(), tokenizer)
    second = to_bridge(GPT2LMHeadModel(config).eval(), tokenizer)
    assert first.cfg.n_layers == second.cfg.n_layers == 1


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.train, "run", interrupted)
    code, err = run_cli(capsys, "train", "--out", str(tmp_path / "run"), *TINY_TRAIN)
    assert code == 130
    assert err.strip().splitlines() == [
        "mistill-lens train: interrupted: the checkpoint of the last --checkpoint-every step is kept in --out; "
        "rerun the same command to resume"
    ]


def test_ctrl_c_on_a_real_training_run_leaves_a_resumable_checkpoint(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "mistill_lens.cli",
        "train",
        "--out",
        str(out),
        "--steps",
        "100000",
        "--checkpoint-every",
        "2",
        *TINY_TRAIN,
    ]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "training_state.pt").exists() and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert (
        err.strip().splitlines()[-1].startswith("mistill-lens train: interrupted:")
        and "Traceback" not in err
    )
    state = torch.load(out / "training_state.pt", weights_only=False)
    assert state["step"] >= 2 and state["step"] % 2 == 0
    load_hf_model(out)  # the kept checkpoint is whole


def test_an_interrupted_sweep_resumes_to_the_uninterrupted_result(
    planted, planted_data, tmp_path, monkeypatch
):
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    straight = ablation_sweep(bridge, batch, means, tmp_path / "straight.csv", progress=False)
    real = FullForward.sweep_heads
    calls = []

    def interrupt_third_head(*args, **kwargs):  # on the full forward a sweep group is one head
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(FullForward, "sweep_heads", interrupt_third_head)
    with pytest.raises(KeyboardInterrupt):
        ablation_sweep(bridge, batch, means, tmp_path / "sweep.csv", progress=False)
    monkeypatch.undo()
    assert len(pd.read_csv(tmp_path / "sweep.csv")) == 2 * len(batch)
    resumed = ablation_sweep(bridge, batch, means, tmp_path / "sweep.csv", progress=False)
    pd.testing.assert_frame_equal(resumed, straight)


def test_no_progress_silences_every_bar_including_model_loading(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mistill_lens.cli", "evaluate", "--n", "1", "--no-progress"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0 and result.stderr == ""
    assert json.loads(result.stdout.splitlines()[-1])["n"] == 1


def test_a_characterisation_config_shares_nothing_with_its_default():
    """Editing a result's config (a notebook habit) must not change the default of later calls."""
    from dataclasses import FrozenInstanceError, replace

    from mistill_lens.lens.characterize import CharacterizeConfig

    default = CharacterizeConfig()
    derived = replace(default, elicitation_kind="region")
    derived.thresholds["necessity"] = 0.9
    assert default.thresholds["necessity"] == 0.5
    assert CharacterizeConfig().thresholds["necessity"] == 0.5
    with pytest.raises(FrozenInstanceError):
        derived.seed = 3
