"""MISTILL: distil the teacher's decision mechanism (its pooled attention at decision events) into
same-family and cross-family students, and measure the students' causal recovery.

Modules: `align` (cross-tokenizer mass transfer by character spans), `data` (the teacher's
generations as distillation data), `attention` (targets, student pooled attention, the loss),
`students` (Llama / GPT-2 students, precision modes), `training`, `evaluation` (characterise the
student afresh, causal recovery, task accuracy), `report`, `pipeline` (the commands).
"""

FAMILIES = ("llama", "gpt2")
OBJECTIVES = ("cot", "mistill")
PRECISIONS = ("bf16", "fp32-master")
