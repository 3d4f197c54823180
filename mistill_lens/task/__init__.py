"""The synthetic clinical-coding task on the real ICD-10-CM hierarchy: the label universe (`icd`),
examples with prompts, reasoning traces and gold decision events (`examples`), its metrics and
greedy evaluation (`metrics`), its tokenizers' construction (`build_tokenizers`), and zero-shot
selection by a pretrained chat model (`zero_shot`).

``from mistill_lens import task`` gives the examples API (``task.generate_examples`` and so on).
"""

from mistill_lens.task.examples import (  # noqa: F401
    CANDIDATES_HEADER,
    CODES_HEADER,
    DEFAULT_K,
    DEFAULT_MAX_MENTIONS,
    EVENT_KINDS,
    FILLER_SENTENCES,
    NEGATED_TEMPLATES,
    POSITIVE_TEMPLATES,
    PROMPT_HEADER,
    REASONING_HEADER,
    REJECTION_REASONS,
    SPLITS,
    TRACE_LINE,
    Example,
    Mention,
    TraceLine,
    build_example,
    check_task_config,
    example_at,
    generate_examples,
    iter_examples,
    mention_wording,
    min_k,
    parse_output,
    read_jsonl,
    render_prompt,
    write_jsonl,
)
from mistill_lens.task.icd import DEFAULT_UNIVERSE_SIZE  # noqa: F401
