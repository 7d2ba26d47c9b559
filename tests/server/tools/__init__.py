"""Tests of tools and what is read out of a reply (server/tools)."""
