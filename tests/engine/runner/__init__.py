"""Tests of engine/runner/: decode graphs and the no-host-sync rule of a step."""
