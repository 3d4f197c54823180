"""A characterisation run into a folder, as the command does it: the folder claimed, the sweeps
resumable there, the files written."""

from mistill_lens.lens.characterize import characterize
from mistill_lens.lens.outputs import prepare_output, write_characterization


def characterize_into(out_dir, *args, **kwargs) -> dict:
    """:func:`characterize` with its sweeps and files in `out_dir`; returns the summary."""
    out = prepare_output(out_dir)
    result = characterize(*args, sweep_dir=out, **kwargs)
    write_characterization(result, out)
    return result.summary()
