"""The compute choice: bf16 autocast only where the device has bf16 units, recorded by each run,
and a distillation run never resumed in another compute than it started in."""

import pandas as pd
import pytest
import torch

from mistill_lens.distill.report import check_pairs
from mistill_lens.models.precision import (
    compute_context,
    compute_mode,
    cpu_has_bf16_units,
)

AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: amx_bf16\n"  # not a flags line


def test_bf16_units_are_read_from_the_cpu_flags_only():
    assert cpu_has_bf16_units(AMX)
    assert not cpu_has_bf16_units(AVX2)
    assert not cpu_has_bf16_units("")


@pytest.mark.parametrize(
    "device, precision, units, expected",
    [
        ("cpu", "fp32-master", True, "bf16-autocast"),
        ("cpu", "fp32-master", False, "float32"),
        ("cpu", "fp32", True, "float32"),
        ("cpu", "bf16", False, "bfloat16"),
        ("cuda", "fp32", False, "bf16-autocast"),
        ("cuda", "fp32-master", False, "bf16-autocast"),
    ],
)
def test_compute_mode(device, precision, units, expected):
    assert compute_mode(device, precision, bf16_units=units) == expected


def test_the_compute_context_autocasts_only_in_bf16_autocast():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with compute_context("cpu", "bf16-autocast"):
        assert (a @ b).dtype == torch.bfloat16
    with compute_context("cpu", "float32"):
        assert (a @ b).dtype == torch.float32
    with pytest.raises(ValueError, match="compute mode must be one of"):
        compute_context("cpu", "fp16")


def test_arms_that_computed_differently_are_not_a_pair():
    def row(objective, compute):
        return {
            "seed": 0,
            "run": objective,
            "precision": "fp32-master",
            "paired": {"data": "a"},
            "compute": compute,
        }

    # a record without compute ran fp32-master under bf16 autocast: a pair with one that says so
    check_pairs(pd.DataFrame([row("cot", None), row("mistill", "bf16-autocast")]), [0])
    with pytest.raises(ValueError, match="computed in bf16-autocast and float32"):
        check_pairs(pd.DataFrame([row("cot", None), row("mistill", "float32")]), [0])
