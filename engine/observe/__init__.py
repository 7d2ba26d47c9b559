"""Watching the engine: Prometheus metrics (with vLLM's names), the gauges snapshot /metrics and
the health endpoints read after every step, and the dashboard's detailed state between steps."""
