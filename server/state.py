"""What every handler shares: the engine, the served model name, the limits, the response store,
the connection guard, and the ids of the engine requests in flight (so shutdown can abort
them); the check that a request's ``model`` is served (the base model's names or a LoRA
adapter's, which the request then runs on); and the check each endpoint starts with that the
model is of its kind (one server per model kind, as vLLM: a generating model answers the
generation endpoints, a pooling model the pooling ones)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.pooling.pooling_model import PoolingModel
from paged_serve.server.generation.defaults import NO_DEFAULTS, SamplingDefaults
from paged_serve.server.http.connections import ConnectionGuard
from paged_serve.server.http.limits import ServerLimits
from paged_serve.server.media.config import MediaConfig
from paged_serve.server.protocol.errors import SERVER_ERROR, APIError
from paged_serve.server.responses.store import ResponseStore


@dataclass(slots=True)
class ServerState:
    """One per app. ``api_key_hashes`` is empty when the server runs without ``--api-key``.
    ``served_model_name`` is the name replies carry; ``served_model_names`` every name a request
    may ask for (it first), as vLLM's ``--served-model-name A B``."""

    engine: AsyncEngine
    served_model_name: str
    limits: ServerLimits
    store: ResponseStore
    connections: ConnectionGuard
    api_key_hashes: tuple[str, ...] = ()
    served_model_names: tuple[str, ...] = ()
    sampling_defaults: SamplingDefaults = NO_DEFAULTS
    tool_call_parser: str | None = None  # None: chosen from the chat template
    reasoning_parser: str | None = None  # None: reasoning stays in content
    media: MediaConfig = field(default_factory=MediaConfig)  # where images may come from
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: set[str] = field(default_factory=set)
    shutting_down: bool = False

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is absent, a served name of the base model or a served LoRA
        adapter's name."""
        self.lora_for(model)

    def lora_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request runs on: ``model`` when it names a served adapter, None
        for the base model (``model`` absent or one of its names). 404 for any other name, so
        that a request whose adapter was unloaded after ``check_model`` never runs on the base
        model instead."""
        if model is None or model in self.model_names:
            return None
        loras = self.engine.loras
        if loras is None or loras.get(model) is None:
            raise model_not_found(model, self.model_names + self.adapter_names())
        return model

    def reply_model(self, model: str | None) -> str:
        """The ``model`` a reply carries: the adapter's name for a request on an adapter (as
        vLLM), else the base model's first served name."""
        return self.lora_for(model) or self.served_model_name

    def adapter_names(self) -> tuple[str, ...]:
        """The served LoRA adapters' names, in load order (none without ``--enable-lora``)."""
        loras = self.engine.loras
        return () if loras is None else tuple(a.name for a in loras.served())

    def check_engine_alive(self) -> None:
        """503 ``engine_dead`` unless the engine loop (and every tensor-parallel rank) runs."""
        if not self.engine.is_alive:
            raise APIError(
                503, "the engine loop is not running", type=SERVER_ERROR, code="engine_dead"
            )

    def check_generates(self, endpoint: str) -> None:
        """400 when the model is served for pooling: ``endpoint`` generates text."""
        pooling = self.engine.pooling
        if pooling is not None:
            raise APIError(
                400,
                f"{endpoint} generates text, and this server runs {self.served_model_name!r} as "
                f"a pooling model ({pooling.task}); serve a text-generation model with "
                "--runner generate",
            )

    def pooling_model(self, endpoint: str, task: str | None = None) -> PoolingModel:
        """The served pooling model; 400 when the model generates, or when ``endpoint`` needs
        ``task`` (``embed`` or ``classify``) and the model answers the other."""
        pooling = self.engine.pooling
        name = self.served_model_name
        if pooling is None:
            raise APIError(
                400,
                f"{endpoint} needs an embedding or classification model, and this server runs "
                f"{name!r} for text generation; serve a pooling model with --runner pooling",
            )
        if task is not None and pooling.task != task:
            what = "an embedding" if task == "embed" else "a classification"
            raise APIError(
                400,
                f"{endpoint} needs {what} model, and this server runs {name!r} for "
                f"{pooling.task}; serve one with --convert {task}",
            )
        return pooling

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may ask for, the reply name first."""
        return self.served_model_names or (self.served_model_name,)

    @property
    def context_limit(self) -> int:
        """The longest sequence (prompt plus output) a request may ask for, in tokens: the
        model's context, or the whole KV cache if that is smaller."""
        engine = self.engine
        capacity = engine.snapshot().kv_blocks_total * engine.block_size
        return min(engine.max_model_len, capacity)


def model_not_found(model: str, served: tuple[str, ...]) -> APIError:
    """The 404 for a ``model`` no one serves; ``served``: every name that is."""
    return APIError(
        404,
        f"the model {model!r} does not exist; this server serves "
        + " or ".join(repr(n) for n in served),
        param="model",
        code="model_not_found",
    )


def key_hash(key: str) -> str:
    """What the server keeps of an API key (to scope stored responses and the prefix cache to
    the key)."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_cache_salt(owner: str | None, cache_salt: str | None) -> str | None:
    """The engine's prefix-cache salt for a request: its tenant (``owner``, the digest of the
    API key that authenticated it; None without keys) and the request's own ``cache_salt``,
    joined so that no two pairs give one salt. None when neither is set: the keyless, unsalted
    requests are one tenant and share the unsalted chain.

    Without this, one key's cached prefix would answer another key's identical prompt with
    ``cached_tokens`` and a faster first token: an oracle for what others sent.
    """
    if owner is None and cache_salt is None:
        return None
    return msgspec.json.encode([owner, cache_salt]).decode()


STATE = web.AppKey("paged_serve_state", ServerState)

# Request storage key: the hash of the API key that authenticated the request (absent without
# keys). web.RequestKey is new in aiohttp 3.12; older versions take a plain string.
OWNER = (
    web.RequestKey("paged_serve_owner", str) if hasattr(web, "RequestKey") else "paged_serve_owner"
)
