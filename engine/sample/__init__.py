"""Logits to tokens: the rows a step samples (a drafted sequence's verification rows among
them), the sampler, grammar token masks, logit bias, penalties and min_tokens, the eager
(torch) draw.
"""
