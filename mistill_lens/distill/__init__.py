"""MISTILL: distil the teacher's decision mechanism (its pooled attention at decision events) into
same-family and cross-family students, and measure the students' causal recovery.

Modules: `align` (cross-tokenizer mass transfer by character spans), `data` (the teacher's
generations as distillation data), `attention` (targets, student pooled attention, the loss),
`training` (the MISTILL objective), `evaluation` (characterise the student afresh, causal
recovery, task accuracy), `report`. Students are in `mistill_lens.models.students`; the commands
in `mistill_lens.cli.distill`.
"""

from mistill_lens.models import FAMILIES, PRECISIONS  # noqa: F401  (re-exported: the distill options)

OBJECTIVES = ("cot", "mistill")

from mistill_lens.namespace import lazy_submodules  # noqa: E402

__getattr__ = lazy_submodules(__name__, __file__)
