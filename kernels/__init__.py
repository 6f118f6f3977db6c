"""Attention kernels: a PyTorch reference (`reference.py`) that runs anywhere, and Triton
kernels that must match it."""
