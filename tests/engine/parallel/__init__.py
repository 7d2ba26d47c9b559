"""Tests of tensor parallelism (engine/parallel/, engine/model/sharding.py): TP=2 equals TP=1 and
Hugging Face, quantized weights under TP.
"""
