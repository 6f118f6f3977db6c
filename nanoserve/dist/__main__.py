"""A tensor-parallel worker process, started by `WorkerPool` (nanoserve/dist/launch.py):

    python -m nanoserve.dist RANK WORLD_SIZE DEVICE INIT_METHOD PARENT_PID
"""
import sys

import torch

from nanoserve.dist.launch import exit_with_parent, run_worker

rank, world_size, device, init_method, parent_pid = sys.argv[1:6]
exit_with_parent(int(parent_pid))
run_worker(int(rank), int(world_size), torch.device(device), init_method)
