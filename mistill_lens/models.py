"""Model configs, checkpoints and the one loading path into TransformerBridge.

Checkpoints are ordinary Hugging Face ``save_pretrained`` folders (``config.json``,
``model.safetensors``, the tokenizer files) plus ``mistill.json`` recording the command, seed
and training figures that produced them. Every hook-based analysis loads a checkpoint as a
TransformerLens 4 :class:`TransformerBridge`.
"""

from __future__ import annotations

import json
import copy
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from mistill_lens.runs import commit_staged, file_digest, finish_interrupted_commit, staging_dir
from mistill_lens.tokenization import load_tokenizer

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TEACHER = ASSETS / "teacher"
METADATA_FILE = "mistill.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint folder that is missing, corrupt, or does not match its tokenizer."""


def teacher_config(
    vocab_size: int,
    *,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    n_positions: int = 1024,
    eos_token_id: int = 0,
) -> GPT2Config:
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        tie_word_embeddings=True,
    )


def resolve(spec: str | Path) -> Path:
    """``default`` names the shipped teacher; anything else is a checkpoint folder."""
    return DEFAULT_TEACHER if str(spec) == "default" else Path(spec)


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: str | Path,
    metadata: dict,
    training_state: dict[str, dict] | None = None,
) -> Path:
    """Write a checkpoint into ``out_dir``, replacing only the checkpoint's own files, atomically
    as a set (:mod:`mistill_lens.runs`): a crash leaves the previous checkpoint or the new one.

    ``training_state`` maps file names to objects saved with ``torch.save`` (optimizer state
    for resuming). A ``manifest.json`` of file digests is written with them.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out_dir)
    # One shard: transformers' per-shard progress bar would only clutter logs of long runs.
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(staging, safe_serialization=True)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(staging)
    (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    for name, state in (training_state or {}).items():
        torch.save(state, staging / name)
    commit_staged(out_dir)
    return out_dir


def weights_digest(spec: str | Path) -> str:
    """Short SHA-256 of a checkpoint's weights file: the cache key of everything derived from it."""
    path = resolve(spec)
    if not (path / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"checkpoint {path} has no {WEIGHTS_FILE}" if path.is_dir()
                              else f"checkpoint folder {path} does not exist")
    return file_digest(path / WEIGHTS_FILE)[:16]


def read_metadata(spec: str | Path) -> dict:
    path = resolve(spec) / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def load_hf_model(
    spec: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The Hugging Face model and tokenizer of a checkpoint, with clear errors for bad folders.

    ``sdpa`` is what training uses, so logits reproduce the trained model exactly; the bridge
    loads with ``eager`` attention.
    """
    path = resolve(spec)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if path != DEFAULT_TEACHER:
        finish_interrupted_commit(path)
    for name in ("config.json", WEIGHTS_FILE, "tokenizer.json"):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} has no {name}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path} could not be loaded (corrupt or incomplete weights): {err}") from err
    tokenizer = load_tokenizer(path)
    embedding_rows = model.get_input_embeddings().weight.shape[0]
    if embedding_rows != len(tokenizer):
        raise CheckpointError(
            f"checkpoint {path}: the model has {embedding_rows} embedding rows but its tokenizer has "
            f"{len(tokenizer)} tokens (mismatched tokenizer)"
        )
    model.eval()
    return model, tokenizer


def to_bridge(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, dtype: torch.dtype = torch.float32):
    """Wrap a Hugging Face model in a TransformerBridge (it adapts ``model`` in place).

    The bridge gets its own copy of the tokenizer: TransformerLens 4.3 edits the tokenizer it is
    given, and a second bridge on the same object fails with ``KeyError: 'name_or_path'``.
    """
    from transformer_lens import TransformerBridge

    bridge = TransformerBridge.boot_transformers(
        model.config.model_type, hf_model=model, tokenizer=copy.deepcopy(tokenizer), device="cpu", dtype=dtype
    )
    bridge.eval()
    return bridge


def load_model(spec: str | Path, dtype: torch.dtype = torch.float32):
    """``(TransformerBridge, tokenizer)`` for a checkpoint folder or ``default``."""
    model, tokenizer = load_hf_model(spec, dtype=dtype, attn_implementation="eager")
    return to_bridge(model, tokenizer, dtype=dtype), tokenizer
