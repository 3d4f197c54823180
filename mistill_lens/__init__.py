"""mistill_lens: mechanistic interpretability of reasoning in large output spaces, on TransformerLens 4.

The notebook surface, one import away::

    import mistill_lens as ml
    model, tokenizer = ml.load_model("default")            # the shipped teacher, as a TransformerBridge
    batch = ml.make_event_batch(ml.encode(examples, tokenizer))
    means = ml.means_from_events(model, ml.make_event_batch(ml.encode(reference, tokenizer)))
    hooks = ml.mean_ablation_hooks(model, ["L23H3"], means, ml.event_position_classes(batch, means.class_names))
    ml.run_margins(model, batch, hooks)
    found = ml.characterize(model, tokenizer, examples, reference)   # a Characterization
    found.circuits, found.summary(), ml.write_characterization(found, "runs/mine")

These names (``ml.__all__``, listed in the README) load lazily: importing the package stays cheap.
Everything else lives in the wings, themselves attributes of the package: ``ml.lens`` (the
task-free toolkit, one module per concept: ``ml.lens.sweep``, ``ml.lens.circuits``, ...),
``ml.models``, ``ml.task`` (the ICD task), ``ml.training``, ``ml.distill``.
"""

from importlib import import_module

_API = {
    "mistill_lens.models.checkpoints": ("load_model",),
    "mistill_lens.lens.characterize": ("characterize", "encode"),
    "mistill_lens.lens.results": ("CharacterizeConfig", "Characterization"),
    "mistill_lens.lens.outputs": ("write_characterization", "read_characterization"),
    "mistill_lens.lens.examples": ("read_examples", "SpanExample"),
    "mistill_lens.lens.events": ("DecisionEvent", "EventBatch", "make_event_batch"),
    "mistill_lens.lens.contrasts": ("freeze_contrasts",),
    "mistill_lens.lens.backends": ("means_from_events",),
    "mistill_lens.lens.hooks": (
        "HeadMeans",
        "mean_ablation_hooks",
        "ablate_all_but_hooks",
        "knock_in_hooks",
        "event_position_classes",
    ),
    "mistill_lens.lens.margins": ("run_margins", "attribution_scores"),
    "mistill_lens.lens.engine": ("InterventionEngine",),
    "mistill_lens.lens.sweep": ("ablation_sweep",),
    "mistill_lens.lens.calibration": ("calibrate", "null_events"),
    "mistill_lens.lens.circuits": ("circuit_report",),
    "mistill_lens.lens.plot": ("head_map_figure", "write_figure"),
    "transformer_lens.utilities": ("get_act_name",),  # hook names, as TransformerLens spells them
}
_WINGS = ("lens", "models", "task", "training", "distill")
_WHERE = {name: module for module, names in _API.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
    elif name in _WINGS:
        value = import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(
            f"module 'mistill_lens' has no attribute {name!r}: the public names are in "
            f"mistill_lens.__all__; the rest lives in the wings {', '.join(_WINGS)} "
            "(e.g. mistill_lens.lens.sweep)"
        )
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_WINGS))
