"""nanoserve's kernels, two paths for each: a PyTorch reference that runs anywhere
(`reference.py`, `fused_ops.py`) and what must match it: Triton kernels for the GPU
(`paged_attention.py`, `store_kv.py`, `fused.py`; interpreted on a CPU under TRITON_INTERPRET=1)
and the CPU's (`cpu_attention.py`, `cpu_linear.py`, and C compiled on first use from the sources
shipped beside them: `cpu_decode_attention.c`, `cpu_fused.c`, `cpu_common.h`, by `cpu_build.py`).
This package imports nothing else of nanoserve's."""
