"""Tensor-parallel plumbing over torch.distributed: sharding the model, a rank's process groups
and step channel, the loopback rendezvous, the step message the driver broadcasts. The executor
that starts and runs the ranks is engine/executor/.
"""
