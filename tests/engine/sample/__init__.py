"""Tests of engine/sample/: the sampler, the eager draw, logit adjustments, grammar masks and their
fill budget, min_tokens beside a grammar.
"""
