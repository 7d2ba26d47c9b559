"""Tensor parallelism over torch.distributed: sharding the model, the process group, the worker
ranks and their processes, the loopback rendezvous, the step message the driver broadcasts.
"""
