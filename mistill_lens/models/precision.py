"""What a training run computes in, chosen in one place: bfloat16 autocast where the device has
bf16 matrix units, float32 where it has not.

Why a choice: on a CPU with AMX-bf16 a bf16 matrix product ran ~6x faster than float32, and an
fp32-master step (float32 weights, forward and backward under bf16 autocast) 1.55x faster than a
float32 one. On a CPU without bf16 units torch falls back to a scalar path: a 1024x2048x2048
product ran at 0.1 GFLOP/s in bf16 against 78 GFLOP/s in float32 (AMD EPYC, AVX2 only,
2026-12-07), and one SmolLM2 + LoRA distillation step under autocast took ~230 s against ~6.5 s
on the AMX machine. There an fp32-master run computes in float32 (its weights and optimizer are
float32 either way), and the run records which it did (``compute``), since the numerics differ.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import lru_cache
from pathlib import Path

import torch

# CPU flags (Linux /proc/cpuinfo) of bf16 matrix units that torch's CPU kernels use
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
COMPUTE_MODES = ("bf16-autocast", "float32", "bfloat16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_bf16_units(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has bf16 matrix units (any of :data:`BF16_CPU_FLAGS` among the flags of
    `cpuinfo`, by default this machine's /proc/cpuinfo; False where it cannot be read)."""
    if cpuinfo is None:
        return _this_cpu_has_bf16_units()
    flags = {
        flag
        for line in cpuinfo.splitlines()
        if line.startswith("flags")
        for flag in line.partition(":")[2].split()
    }
    return any(flag in flags for flag in BF16_CPU_FLAGS)


@lru_cache(maxsize=1)
def _this_cpu_has_bf16_units() -> bool:
    try:
        return cpu_has_bf16_units(CPUINFO.read_text())
    except OSError:
        return False


def compute_mode(device_type: str, precision: str, bf16_units: bool | None = None) -> str:
    """What a run of `precision` ("fp32", "fp32-master" or "bf16": its weights) computes in on
    `device_type`: "bfloat16" for bf16 weights; otherwise "bf16-autocast" on a GPU, and on a CPU
    for fp32-master where it has bf16 units (`bf16_units`, default: this CPU's), else "float32"."""
    if precision == "bf16":
        return "bfloat16"
    if device_type == "cuda":
        return "bf16-autocast"
    if bf16_units is None:
        bf16_units = cpu_has_bf16_units()
    return "bf16-autocast" if precision == "fp32-master" and bf16_units else "float32"


def legacy_compute(device_type: str, precision: str) -> str:
    """What a run recorded before compute was recorded computed in, by the rule of its time: bf16
    weights in bfloat16; otherwise bf16 autocast on a GPU or with fp32-master (whatever the CPU),
    float32 else."""
    if precision == "bf16":
        return "bfloat16"
    bf16 = device_type == "cuda" or precision == "fp32-master"
    return "bf16-autocast" if bf16 else "float32"


def compute_context(device_type: str, mode: str) -> AbstractContextManager:
    """The context a forward and backward of `mode` run in (autocast for "bf16-autocast")."""
    if mode not in COMPUTE_MODES:
        raise ValueError(f"compute mode must be one of {COMPUTE_MODES}, got {mode!r}")
    if mode == "bf16-autocast":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()
