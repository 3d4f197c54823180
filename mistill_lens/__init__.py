"""mistill_lens: mechanistic interpretability of reasoning in large output spaces, on TransformerLens 4.

The notebook surface, one import away::

    import mistill_lens as ml
    model, tokenizer = ml.load_model("default")            # the shipped teacher, as a TransformerBridge
    encoded = [ml.events_from_spans(x, tokenizer, i) for i, x in enumerate(examples)]
    batch = ml.make_event_batch(encoded)
    hooks = ml.mean_ablation_hooks(model, [(3, 3)], means, ml.event_position_classes(batch, means.class_names))
    ml.run_margins(model, batch, hooks)
    found = ml.characterize(model, tokenizer, examples, reference)   # a Characterization
    found.circuits, found.summary(), ml.write_characterization(found, "runs/mine")

Names load lazily (importing the package stays cheap); ``dir(mistill_lens)`` lists them. The wings:
``lens`` (task-free toolkit), ``models``, ``task`` (the ICD task), ``training``, ``distill``, ``cli``.
"""

from importlib import import_module

_API = {
    "mistill_lens.models.checkpoints": (
        "load_model",
        "read_metadata",
        "resolve",
        "load_hf_model",
        "to_bridge",
        "save_checkpoint",
        "CheckpointError",
    ),
    "mistill_lens.lens.events": (
        "DecisionEvent",
        "EncodedExample",
        "EventBatch",
        "events_from_spans",
        "events_from_generation",
        "make_event_batch",
        "decision_margins",
        "margin_fraction",
        "decided_rows",
        "position_class_names",
    ),
    "mistill_lens.lens.hooks": (
        "HeadMeans",
        "mean_ablation_hooks",
        "ablate_all_but_hooks",
        "knock_in_hooks",
        "gather_at_positions",
        "attribution_scores",
        "compute_head_means",
        "event_position_classes",
        "collect_z",
        "run_margins",
        "all_heads",
        "validate_heads",
        "row_head_ablation_hooks",
    ),
    "mistill_lens.lens.engine": ("InterventionEngine", "EngineMismatch", "event_view"),
    "mistill_lens.lens.backends": (
        "means_from_events",
        "EngineFallbackWarning",
        "EngineUnsupported",
        "FullForward",
        "backend_for",
    ),
    "mistill_lens.lens.calibration": ("Calibration", "calibrate", "null_events"),
    "mistill_lens.lens.sweep": (
        "ablation_sweep",
        "ablated_margins",
        "clean_margins",
        "chunked_margins",
        "effects_tensor",
    ),
    "mistill_lens.lens.circuits": (
        "select_circuit",
        "circuit_report",
        "CircuitReport",
        "necessity",
        "sufficiency",
        "knock_in_transfer",
        "knock_in_donors",
        "ablation_curve",
        "phase_structure",
        "family_targets",
        "attention_mass",
        "head_families",
    ),
    "mistill_lens.lens.elicitation": (
        "elicitation_curve",
        "elicitation_lead",
        "carrying_heads",
        "top_heads",
    ),
    "mistill_lens.lens.characterize": ("characterize", "encode", "reference_means"),
    "mistill_lens.lens.results": ("CharacterizeConfig", "Characterization"),
    "mistill_lens.lens.outputs": ("write_characterization", "read_characterization"),
    "mistill_lens.lens.examples": ("read_examples", "SpanExample", "SpanEvent"),
    "mistill_lens.lens.plot": (
        "head_map_figure",
        "ablation_curve_figure",
        "attention_families_figure",
        "elicitation_figure",
        "event_margins_figure",
        "attention_row_figure",
        "token_labels",
        "write_figure",
    ),
    "mistill_lens.task.characterize": ("characterize_task", "task_examples"),
    "mistill_lens.task.examples": ("generate_examples",),
    "mistill_lens.distill.teacher": ("teacher_characterization", "teacher_task_config"),
}
_API["transformer_lens.utilities"] = ("get_act_name",)  # hook names, as TransformerLens spells them
_WHERE = {name: module for module, names in _API.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mistill_lens' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
