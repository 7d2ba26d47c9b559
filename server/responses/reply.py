"""One Responses API reply: the Response object at each status, its output items, and the
stored result (``paged_serve.server.responses.store``) a follow-up continues.

The handlers (``paged_serve.server.responses.handlers``) make one per request; a stream's events
come from a ``ResponseStream`` over it (``paged_serve.server.responses.stream``), and a
background run (``paged_serve.server.responses.background``) drives it from a task of its own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import msgspec

from paged_serve.engine.outputs import TokenLogprob
from paged_serve.server.generation.logprobs import chat_logprobs
from paged_serve.server.generation.run import Generation
from paged_serve.server.protocol.errors import APIError
from paged_serve.server.protocol.logprobs import ChatTokenLogprob
from paged_serve.server.protocol.responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from paged_serve.server.responses.store import StoredResponse
from paged_serve.server.responses.tools import assistant_message, new_item_id
from paged_serve.server.state import ServerState
from paged_serve.server.tools.planning import ToolPlan


class ResponseReply:
    """Builds the Response object and stores the result; a ``ResponseStream``
    (``paged_serve.server.responses.stream``) makes a stream's events from it."""

    def __init__(
        self,
        state: ServerState,
        body: ResponsesRequest,
        owner: str | None,
        messages: list[dict],
        prompt_tokens: int,
        plan: ToolPlan,
    ):
        self.plan = plan
        self.state = state
        self.body = body
        self.model = state.reply_model(body.model)  # a LoRA adapter's name, as vLLM's replies
        self.owner = owner
        self.messages = messages  # the conversation so far, without the instructions
        self.prompt_tokens = prompt_tokens
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.with_logprobs = body.output_logprobs is not None
        self.final: Response | None = None  # set by finish (and ended)

    def response(
        self,
        status: str,
        output: list[OutputMessage | FunctionCallItem],
        usage: ResponseUsage | None,
        error: ResponseError | None = None,
    ) -> Response:
        """The Response object at ``status``, echoing the request's settings."""
        b = self.body
        return Response(
            id=self.id,
            created_at=self.created,
            completed_at=int(time.time()) if status == "completed" else None,
            status=status,
            error=error,
            incomplete_details=(
                IncompleteDetails("max_output_tokens") if status == "incomplete" else None
            ),
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            model=self.model,
            output=output,
            previous_response_id=b.previous_response_id,
            background=bool(b.background),
            store=b.store,
            temperature=b.temperature,
            top_p=b.top_p,
            text=TextConfig(b.text.format) if b.text and b.text.format else TextConfig(),
            metadata=b.metadata or {},
            tools=msgspec.to_builtins(b.tools) if b.tools else [],
            tool_choice=(
                msgspec.to_builtins(b.tool_choice)
                if b.tool_choice is not None
                else ("auto" if b.tools else "none")
            ),
            parallel_tool_calls=b.parallel_tool_calls is not False,
            max_tool_calls=b.max_tool_calls,
            top_logprobs=b.top_logprobs or 0,
            user=b.user,
            safety_identifier=b.safety_identifier,
            prompt_cache_key=b.prompt_cache_key,
            usage=usage,
        )

    def running(self, status: str) -> Response:
        """A background response that has not ended (``queued``, ``in_progress``)."""
        return self.response(status, [], None)

    def ended(self, status: str, err: APIError | None = None) -> Response:
        """A background response that ended without output: ``cancelled``, or ``failed``
        with ``err``; stored (background responses always are), its conversation the input."""
        error = ResponseError(code="server_error", message=err.message) if err else None
        response = self.response(status, [], None, error)
        self._store(response, self.messages)
        return response

    def _store(self, response: Response, conversation: list[dict]) -> None:
        self.final = response
        if self.body.store:
            entry = StoredResponse.encode(
                response,
                conversation,
                self.owner,
                background=bool(self.body.background),
                status=response.status,
            )
            self.state.store.put(self.id, entry)

    def token_logprobs(self, logprobs: Sequence[TokenLogprob] | None) -> list[ChatTokenLogprob]:
        """The tokens' logprob entries if the request includes them, else none."""
        if not (self.with_logprobs and logprobs):
            return []
        return chat_logprobs(self.state.engine.tokenizer, logprobs).content

    def message(self, status: str, parts: list[OutputText]) -> OutputMessage:
        """The reply's one message item (the same id in every event and the final Response)."""
        return OutputMessage(id=self.message_id, status=status, content=parts)

    def finish(
        self,
        content: str,
        calls: list[FunctionCallItem],
        finish_reason: str | None,
        cached_tokens: int,
        output_tokens: int,
        *,
        with_message: bool,
        logprobs: list[ChatTokenLogprob] | None = None,
    ) -> Response:
        """The final Response object: the message (``with_message``: the reply has one, which
        holds ``content``), then the calls; stored when asked to. ``logprobs``: the message
        text's tokens."""
        status = "incomplete" if finish_reason == "length" else "completed"
        usage = ResponseUsage(
            input_tokens=self.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=self.prompt_tokens + output_tokens,
        )
        output: list[OutputMessage | FunctionCallItem] = []
        if with_message:
            part = OutputText(text=content, logprobs=logprobs or [])
            output.append(self.message(status, [part]))
        output += calls
        response = self.response(status, output, usage)
        self._store(response, [*self.messages, assistant_message(content, calls)])
        return response

    async def complete(self, generation: Generation) -> Response:
        [choice] = await generation.collect()
        content, calls = choice.text, []
        if self.plan.parser is not None:
            text, tool_calls = self.plan.reply(choice.text)
            content = text or ""
            calls = [
                FunctionCallItem(
                    id=new_item_id(),
                    call_id=c.id,
                    name=c.function.name,
                    arguments=c.function.arguments,
                )
                for c in tool_calls
            ]
        return self.finish(
            content,
            calls,
            choice.finish_reason,
            choice.num_cached_tokens,
            generation.completion_tokens,
            with_message=self.has_message(content, bool(calls)),
            logprobs=self.token_logprobs(choice.logprobs),
        )

    def has_message(self, content: str, has_calls: bool) -> bool:
        """Whether the output holds a message: with text, or as the whole reply when there
        are no calls; never for a forced reply (``required``, a named function), whose
        unfinished call ``max_tokens`` cut leaves the output empty."""
        return bool(content) or not (has_calls or self.plan.forced)
