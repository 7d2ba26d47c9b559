"""Speculative decoding's drafting side: drafters (prompt lookup, a draft model) behind one
interface, the per-sequence speculator (how far each sequence drafts) and its configuration.
The target's verification rows are engine/sample/sampling_rows.py; the accepted runs are
counted by the scheduler after the step (engine/sched/scheduler.py).
"""
