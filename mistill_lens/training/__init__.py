"""Training on the task: one resumable loop for teachers (from scratch or LoRA on a pretrained
base) and base students (`loop`), on the encoded examples of `data`, the model and tokenizer of
`models`, configured by `config`, resuming from `checkpoint_state`; the distillation objective
builds on it (`mistill_lens.distill`)."""

from mistill_lens.namespace import lazy_submodules  # noqa: E402

__getattr__ = lazy_submodules(__name__, __file__)
