"""Tests of engine/observe/: the engine-state snapshot the dashboard reads."""
