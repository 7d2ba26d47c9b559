"""The tensor-parallel executor: the driver's handle that starts, watches and stops its worker
ranks (``workers.py``), and a worker rank's whole process (``rank.py``). It builds each rank's
runner (engine/runner/build.py) over the plumbing of engine/parallel/ (process groups, the
rendezvous); nothing in engine/parallel/ imports it.
"""
