"""Every Triton kernel variant compiles for a Hopper GPU (sm_90) on this machine, GPU or not
(tests/compile_kernels.py): CI's interpreter checks what the kernels compute, this checks that
the compiler takes them, so a GPU session does not find out first."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "compile_kernels.py"


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_hopper():
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError as e:  # a Triton without its NVIDIA back end cannot compile for one
        pytest.skip(f"Triton's NVIDIA back end is not installed: {e}")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAIL"))]
    failures = [line for line in lines if line.startswith("FAIL")]
    assert not failures and proc.returncode == 0, "\n".join(failures) or proc.stderr[-3000:]
    assert len(lines) >= 15, proc.stdout + proc.stderr[-3000:]
