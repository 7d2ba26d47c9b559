"""``POST /v1/completions``: the request, and the ``text_completion`` object, whole and as
stream chunks (a completions stream sends ``text_completion`` objects with one choice each).

vLLM's ``return_token_ids`` adds ``token_ids`` (the completion's, or in a stream the chunk's
new ones) and ``prompt_token_ids`` (in a stream, on its first chunk) to every choice.
Field names follow the OpenAI API reference (plus vLLM's extras, ``SamplingFields``).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from paged_serve.server.protocol.common import ChoiceList, prompt_list
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.field_types import CompletionLogprobCount, NonNegativeInt
from paged_serve.server.protocol.logprobs import CompletionLogprobs, PromptLogprobs
from paged_serve.server.protocol.sampling import SamplingFields


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or token-id lists."""

    prompt: str | list[str | int | list[int]]
    max_tokens: NonNegativeInt | None = 16  # 0 only scores the prompt (echo, prompt_logprobs)
    echo: bool | None = False
    logprobs: CompletionLogprobCount | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.max_tokens = 16 if self.max_tokens is None else self.max_tokens
        self.echo = bool(self.echo)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list; raises APIError (400) for an empty or mixed list."""
        return prompt_list(self.prompt, "prompt")

    def check(self) -> None:
        self.check_sampling()
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise bad_request(
                "max_tokens 0 generates nothing: it only scores the prompt, with echo or "
                "prompt_logprobs",
                "max_tokens",
            )

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position the engine must compute: for ``prompt_logprobs``
        and for ``echo`` with ``logprobs`` (the prompt's tokens then carry logprobs, as in
        OpenAI's legacy API); an echo that generates nothing still runs the prompt (0)."""
        asked = [k for k in (self.prompt_logprobs, self.echo_logprobs) if k is not None]
        if asked:
            return max(asked)
        return 0 if self.echo and self.max_tokens == 0 else None

    @property
    def echo_logprobs(self) -> int | None:
        """Alternatives per echoed prompt token: ``logprobs`` when echoing, else None."""
        return self.logprobs if self.echo else None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked
    prompt_token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids
    token_ids: list[int] | UnsetType = UNSET


class Completion(ChoiceList[CompletionChoice], kw_only=True):
    """A whole completion, and each chunk of a completions stream."""

    object: str = "text_completion"
