"""The value constraints of request fields, as ``msgspec.Meta`` on annotated types.

Decoding checks them, so a bad value is reported with the exact field name
(``paged_serve.server.protocol.errors.from_decode_error``); rules that involve several fields are
``check()`` methods on the request Structs.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from paged_serve.engine.sampling_params import MAX_LOGPROBS, MAX_N

MAX_STOP = 4
MAX_STOP_TOKEN_IDS = 64
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
# a logit_bias key is a token id written in ASCII digits; 10 digits hold any int32 id, and a
# bound keeps int() away from Python's 4300-digit limit (a ValueError, once a 500)
MAX_TOKEN_ID_DIGITS = 10

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
# the engine carries top_k as an int32 per row; larger values disable top-k anyway
TopK = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
NumChoices = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
# sample i of n runs with seed + i, which must stay a signed 64-bit integer
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - MAX_N)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
CompletionLogprobCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)]
ChatTopLogprobCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_CHAT_TOP_LOGPROBS)]
# vLLM's prompt_logprobs: alternatives per prompt position (its -1, the whole vocabulary, is not
# offered: a [prompt, vocabulary] reply)
PromptLogprobCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
# OpenAI's limits: 16 metadata pairs, keys up to 64 characters, values up to 512; user ids
# (like safety_identifier) up to 64 characters
MetadataKey = Annotated[str, msgspec.Meta(max_length=64)]
MetadataValue = Annotated[str, msgspec.Meta(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], msgspec.Meta(max_length=16)]
User = Annotated[str, msgspec.Meta(max_length=64)]
# vLLM's cache_salt: a prefix-cache partition; an empty one would partition nothing
CacheSalt = Annotated[str, msgspec.Meta(min_length=1)]
