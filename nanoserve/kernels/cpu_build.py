"""Build and load the CPU's C kernels (ours; issue 23): `cc` at first use, a cached .so after.

PyTorch runs a small op in a few microseconds of dispatch whatever its size, and a decoder layer
on a CPU is about fifteen of them besides its matmuls: at the few rows of a decode step, that
overhead, not arithmetic, is most of the layer (benchmarks/RESULTS.md, issue 23). vLLM's CPU
build runs those parts as C++ kernels; nanoserve's are plain C called through `ctypes`:

    nanoserve/kernels/cpu_decode_attention.c    paged decode attention, K/V read in place
    nanoserve/kernels/cpu_fused.c               RMSNorm (+ residual add), RoPE of q and k, SiLU·mul

Each source is compiled once per (source and the headers beside it, compiler, CPU, OpenMP
library) with `cc -O3 -march=native -fopenmp` (under a second) into ~/.cache/nanoserve/kernels
(or `$NANOSERVE_KERNEL_CACHE`), and linked against the libgomp file torch itself loaded (its
`libgomp.so.1`, or a wheel's renamed copy): the process then has one OpenMP runtime, and the
kernels' parallel regions run on the calling thread's pool, as PyTorch's ops do
(nanoserve/async_engine.py says why a second pool would hurt). A torch without libgomp gets
kernels built without OpenMP (one thread) rather than a second runtime. Where there is no
compiler, the build fails, or `$NANOSERVE_CPU_KERNELS=0`, `load` returns None and the callers
keep their PyTorch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DISABLE_ENV = "NANOSERVE_CPU_KERNELS"  # "0": never build or use the C kernels
CACHE_ENV = "NANOSERVE_KERNEL_CACHE"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def loaded_libgomps() -> set[str]:
    """The libgomp files mapped into this process (Linux; empty where /proc cannot be read)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if "libgomp" in line and line.split()[-1].startswith("/")}


def torch_libgomp() -> str | None:
    """The path of the libgomp PyTorch loaded (Linux), or None (another OpenMP, or none)."""
    torch.ones(1)
    paths = loaded_libgomps()
    return min(paths) if paths else None


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else `cc` or `gcc` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load(source: Path, signatures: dict[str, Sequence[type]]) -> ctypes.CDLL | None:
    """`source` built (or found built) and loaded, each function in `signatures` given its
    argument types and an int result; None where the C kernels are off or cannot be built."""
    if os.environ.get(DISABLE_ENV) == "0" or platform.system() != "Linux":
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler: %s is not built, PyTorch's ops run instead", source.name)
        return None
    gomp = torch_libgomp()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    key = hashlib.sha256(source.read_bytes() + headers + cc.encode() + _cpu_flags().encode()
                         + str(gomp).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "nanoserve" / "kernels")
    target = cache / f"{source.stem}-{key}.so"
    if not target.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: atomic
                built, obj = Path(tmp) / target.name, Path(tmp) / "kernel.o"
                flags = ["-O3", "-march=native", "-fPIC"] + (["-fopenmp"] if gomp else [])
                run: dict[str, Any] = dict(check=True, capture_output=True, timeout=120)
                subprocess.run([cc, *flags, "-c", str(source), "-o", str(obj)], **run)
                # Linked without -fopenmp, which would add the system's libgomp: torch's instead.
                subprocess.run([cc, "-shared", str(obj), "-o", str(built), *([gomp] if gomp else []), "-lm"], **run)
                os.replace(built, target)
        except (OSError, subprocess.SubprocessError) as exc:
            stderr = exc.stderr if isinstance(exc, (subprocess.CalledProcessError, subprocess.TimeoutExpired)) else None
            detail = (stderr or b"").decode(errors="replace")[-500:]
            log.warning("building %s failed (%s %s): PyTorch's ops run instead", source.name, exc, detail)
            return None
    library = ctypes.CDLL(str(target))  # its libgomp is torch's, already loaded: the same one
    for name, argtypes in signatures.items():
        fn = getattr(library, name)
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
    return library
