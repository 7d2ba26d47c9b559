"""Tensor-parallel plumbing over torch.distributed: a rank's process groups (the compute group
and the step channel, which carries the runner's packed step messages) and the loopback
rendezvous. How the model is cut across ranks is engine/model/sharding.py; the executor that
starts and runs the ranks is engine/executor/.
"""
