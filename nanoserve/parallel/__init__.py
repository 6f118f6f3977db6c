"""Scaling one engine past one device: tensor and pipeline parallelism over torch.distributed
(worker processes, the step channel, the driver executor, pipeline stages, point-to-point sends).
The engine uses this floor; KunServe's cluster of engines is `nanoserve/cluster/`."""
