"""The simulator: nanoserve's own schedulers and memory managers on a virtual clock (sim/executor.py)."""
