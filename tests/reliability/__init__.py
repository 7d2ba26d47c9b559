"""Reliability: bad input, overload, disconnects and faults, with nothing lost or leaked."""
