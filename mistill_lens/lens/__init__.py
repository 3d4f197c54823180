"""The task-free toolkit: decision events and margins, interventions as composable hook functions,
null calibration, exact sweeps, circuits and head families, early elicitation, the characterisation
pipeline and its figures. Imports torch, TransformerLens and the package's own utilities only:
never the task, the CLI or the ICD data."""

from mistill_lens.namespace import lazy_submodules  # noqa: E402

__getattr__ = lazy_submodules(__name__, __file__)
