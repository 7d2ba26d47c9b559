"""Tensor-parallel plumbing over torch.distributed: sharding the model, a rank's process groups
and step channel (which carries the runner's packed step messages), the loopback rendezvous.
The executor that starts and runs the ranks is engine/executor/.
"""
