"""Tests of the dashboard, the worker routes and routers (server/ops)."""
