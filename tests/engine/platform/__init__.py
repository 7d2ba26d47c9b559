"""Tests of engine/platform/: the Triton backend end to end and the dtype choice."""
