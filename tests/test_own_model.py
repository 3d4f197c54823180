"""Your own model from one registry (`load_model`, `--model`): the pretrained bases by name, a GGUF
file, a Hugging Face folder written by `save_pretrained`; characterised on your own task through
the command line."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mistill_lens import cli
from mistill_lens.models.checkpoints import CheckpointError, load_model, model_kind
from mistill_lens.models.registry import check_model_spec
from mistill_lens.models.tokenizers import student_tokenizer


def counting_examples(starts, kind="next") -> list[dict]:
    """A task any pretrained model does: continue a count. The decision is the next number, its
    contrast the one after it."""
    rows = []
    for start in starts:
        prompt = "Count: " + ", ".join(str(n) for n in range(start, start + 5)) + ","
        chosen, contrast = f" {start + 5}", f" {start + 6}"
        rows.append(
            {
                "id": f"count-{start}",
                "prompt": prompt,
                "output": chosen,
                "events": [
                    {
                        "kind": kind,
                        "start": len(prompt),
                        "end": len(prompt) + len(chosen),
                        "chosen": chosen,
                        "contrast": contrast,
                    }
                ],
            }
        )
    return rows


def write(rows, path):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_hugging_face_folder_loads_and_equals_its_plain_forward(tmp_path):
    tokenizer = student_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "mine")
    tokenizer.save_pretrained(tmp_path / "mine")
    assert model_kind(tmp_path / "mine") == "folder"
    bridge, loaded_tokenizer = load_model(tmp_path / "mine")
    ids = torch.tensor([loaded_tokenizer("Count: 1, 2, 3,")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(bridge(ids), model(ids).logits, atol=1e-5, rtol=0)


def test_an_architecture_without_a_bridge_is_refused_by_name():
    from transformers import BioGptConfig, BioGptForCausalLM

    from mistill_lens.models.bridge import UnsupportedArchitecture, to_bridge

    tokenizer = student_tokenizer()
    config = BioGptConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    with pytest.raises(UnsupportedArchitecture, match="BioGptForCausalLM: TransformerLens 4"):
        to_bridge(BioGptForCausalLM(config), tokenizer)


def test_models_are_named_by_one_registry_and_unknown_ones_list_the_kinds(tmp_path):
    assert [model_kind(s) for s in ("default", "tiny", "smollm2", "gemma3", "x/m.gguf")] == [
        "shipped",
        "shipped",
        "base",
        "base",
        "gguf",
    ]
    with pytest.raises(CheckpointError, match="does not exist; a model is one of: shipped"):
        load_model(tmp_path / "missing")
    with pytest.raises(
        FileNotFoundError, match="did you mean 'tiny'\\? a model is one of: shipped"
    ):
        check_model_spec("Tiny")
    with pytest.raises(FileNotFoundError, match="GGUF file x/m.gguf does not exist"):
        check_model_spec("x/m.gguf")
    for spec in ("default", "gemma3", tmp_path):
        check_model_spec(spec)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_a_pretrained_model_is_characterised_on_your_own_task_from_the_cli(model, tmp_path, capsys):
    examples = write(counting_examples(range(3, 63, 5)), tmp_path / "mine.jsonl")
    reference = write(counting_examples(range(101, 161, 5)), tmp_path / "reference.jsonl")
    cli.main(
        [
            "characterize",
            "--model",
            model,
            "--examples",
            str(examples),
            "--reference",
            str(reference),
            "--out",
            str(tmp_path / "char"),
            "--no-progress",
        ]
    )
    summary = json.loads((tmp_path / "char" / "summary.json").read_text())
    assert summary["model"] == model
    assert summary["backend"]["name"] == "engine"  # both architectures have an engine adapter
    assert summary["next"]["n_events"] >= 8  # the counts the model continues its way
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["circuit"] == summary["circuit"]


def test_a_pretrained_base_without_your_examples_is_refused_before_any_folder(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["characterize", "--model", "gemma3", "--out", str(tmp_path / "char")])
    assert not (tmp_path / "char").exists()


def test_a_k_beyond_the_models_context_is_refused_before_any_folder(tmp_path):
    from mistill_lens.lens.events import events_from_spans
    from mistill_lens.models.checkpoints import load_model
    from mistill_lens.task.characterize import largest_fitting_k, longest_example
    from mistill_lens.task.examples import generate_examples

    with pytest.raises(SystemExit):
        cli.main(
            [
                "characterize",
                "--model",
                "tiny",
                "--k",
                "200",
                "--n",
                "2",
                "--out",
                str(tmp_path / "c"),
            ]
        )
    assert not (tmp_path / "c").exists()
    bridge, tokenizer = load_model("tiny")
    task = {"universe_size": 12536, "k": 200, "max_mentions": 4}
    fitting = largest_fitting_k(bridge.cfg.n_ctx, tokenizer, 4, 0, "heldout", task)
    longest = {
        k: longest_example(generate_examples(4, 0, "heldout", **{**task, "k": k}), tokenizer)
        for k in (fitting, fitting + 1)
    }
    assert longest[fitting] <= bridge.cfg.n_ctx < longest[fitting + 1]  # the largest that fits
    # the count is the characterisation's own: the examples' tokens with their events placed
    examples = generate_examples(4, 0, "heldout", **{**task, "k": fitting})
    placed = max(len(events_from_spans(e, tokenizer, i).tokens) for i, e in enumerate(examples))
    assert longest[fitting] == placed
