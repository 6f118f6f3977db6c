"""The package as a user installs it: `pip wheel .` holds the CPU kernels' C sources and no
top-level package but `nanoserve`; installed (not editable) into a fresh directory, it serves a
generation from outside the checkout with the C kernels built from the installed copy, and its
console script answers `nanoserve serve --help`."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

GENERATE = """
import sys
from pathlib import Path
import nanoserve
from nanoserve import LLM, SamplingParams
from nanoserve.kernels import cpu_decode_attention, cpu_fused

installed = Path(sys.argv[1]).resolve()
assert Path(nanoserve.__file__).resolve().is_relative_to(installed), nanoserve.__file__
assert cpu_decode_attention.SOURCE.resolve().is_relative_to(installed)
llm = LLM(device="cpu", dtype="float32", kv_cache_tokens=1024, max_num_seqs=2)
assert cpu_decode_attention.available() and cpu_fused.cpu_fused_ops() is not None, "the C kernels did not build"
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print("GENERATED", len(out[0].token_ids), repr(out[0].text))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Without build isolation where setuptools is at hand: no download, and the suite's interpreter.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, cwd=out)
    (path,) = out.glob("nanoserve-*.whl")
    return path


def test_the_wheel_holds_the_c_sources_and_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"nanoserve"}  # no top-level `kernels` (an existing PyPI name), no experiments
    for source in ("cpu_decode_attention.c", "cpu_fused.c", "cpu_common.h"):
        assert f"nanoserve/kernels/{source}" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "nanoserve = nanoserve.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the C kernels are built on Linux only")
def test_the_installed_wheel_serves_with_the_c_kernels(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    # The installed copy first on the path (this environment's editable checkout comes after it),
    # a fresh kernel cache, and a working directory outside the checkout.
    env = {**os.environ, "PYTHONPATH": str(target), "NANOSERVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    env.pop("NANOSERVE_CPU_KERNELS", None)
    run = subprocess.run([sys.executable, "-c", GENERATE, str(target)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "GENERATED 8" in run.stdout
    assert list((tmp_path / "kernels").glob("cpu_decode_attention-*.so")), "built from the installed sources"
    script = target / "bin" / "nanoserve"
    helped = subprocess.run([sys.executable, str(script), "serve", "--help"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--max-num-seqs" in helped.stdout, helped.stderr[-2000:]
