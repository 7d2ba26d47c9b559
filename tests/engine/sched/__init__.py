"""Tests of engine/sched/: the scheduler, the block manager and prefix cache, detokenizing, tenant-
rooted cache keys.
"""
