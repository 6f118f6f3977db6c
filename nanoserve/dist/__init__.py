"""Scaling past one device: tensor and pipeline parallelism over torch.distributed, and
KunServe's cluster of instances (parameter drop, KV exchange, restore)."""
