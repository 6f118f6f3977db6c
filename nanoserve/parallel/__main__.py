"""A worker process of a parallel engine, started by `WorkerPool` (nanoserve/parallel/launch.py):

    python -m nanoserve.parallel RANK TP_SIZE PP_SIZE DEVICE INIT_METHOD PARENT_PID
"""
import sys

import torch

from nanoserve.config import Topology
from nanoserve.parallel.launch import exit_with_parent
from nanoserve.parallel.worker import run_worker

rank, tp_size, pp_size, device, init_method, parent_pid = sys.argv[1:7]
exit_with_parent(int(parent_pid))
run_worker(int(rank), Topology(int(tp_size), int(pp_size)), torch.device(device), init_method)
