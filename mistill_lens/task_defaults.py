"""The ICD task's default options and splits, apart from the task itself: the command line shows
them in every `--help` and checks `--split` against them before anything heavy loads (the task
package parses the ICD-10-CM tabular list on import, ~3 s)."""

SPLITS = ("train", "validation", "heldout")
DEFAULT_K = 64
DEFAULT_MAX_MENTIONS = 4
# The whole eligible list: context length depends on K, not on the universe, and a large
# universe leaves a model nothing to memorise but the selection itself.
DEFAULT_UNIVERSE_SIZE = 12536
