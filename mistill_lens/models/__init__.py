"""Models: checkpoints (one load path, one bridge function), the shipped tokenizers, student
architectures, pretrained GGUF bases, and decoding. Importing this package is cheap (no torch)."""

FAMILIES = (
    "llama",
    "gpt2",
)  # student architecture families: cross-family (Llama) and same-family (GPT-2)
PRECISIONS = ("bf16", "fp32-master")
