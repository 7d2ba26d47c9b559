"""Tests of perf/'s harnesses (workloads, reports, agreement checks) on tiny inputs; timings are
never asserted.
"""
