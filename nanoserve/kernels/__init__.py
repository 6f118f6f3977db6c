"""Attention kernels: a PyTorch reference (`reference.py`) that runs anywhere, and Triton
kernels (`paged_attention.py`, `store_kv.py`) that must match it."""
