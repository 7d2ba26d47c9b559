"""Logits to tokens: the sampler, grammar token masks, logit bias, penalties and min_tokens, the
eager (torch) draw.
"""
