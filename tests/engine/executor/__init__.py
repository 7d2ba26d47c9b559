"""Tests of engine/executor/: worker faults, start-up failures and shutdown of a tensor-parallel
group.
"""
