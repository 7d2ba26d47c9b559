"""Watching the engine: Prometheus metrics and the dashboard's state."""
