"""``paged-serve``: load the model and serve the OpenAI-compatible API until SIGINT/SIGTERM.

On a signal the server stops accepting connections, aborts the requests in flight (their
streams get a final error frame), waits for the handlers to finish, stops the engine and
exits 0. If the engine dies (its loop, or a tensor-parallel worker), the server shuts down the
same way and exits 1: nothing in the process can bring the engine back, so a supervisor should
restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.engine_args import add_engine_args, engine_kwargs
from paged_serve.engine.executor.workers import TensorParallelError
from paged_serve.engine.sampling_params import MAX_LOGPROBS
from paged_serve.server.app import create_app, make_runner
from paged_serve.server.generation.defaults import (
    NO_DEFAULTS,
    SOURCES,
    SamplingDefaults,
    load_sampling_defaults,
)
from paged_serve.server.http.limits import ServerLimits
from paged_serve.server.media.config import DEFAULT_MAX_IMAGES, MediaConfig, image_limit
from paged_serve.server.state import STATE
from paged_serve.server.tools.parsers import PARSERS
from paged_serve.server.tools.reasoning import REASONING_PARSERS
from paged_serve.server.vllm_flags import add_refused_args

logger = logging.getLogger("server")
ENGINE_WATCH_S = 0.5  # how often the server checks that the engine is alive
# A worker's exit is seen at once; the engine loop's own report of it (naming the rank and its
# cause) comes when its step fails on the missing rank, a moment later: wait that long for it.
ENGINE_DEATH_REPORT_S = 5.0
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's: a launch line that relies on it works unchanged


def build_parser() -> argparse.ArgumentParser:
    """``paged-serve``'s flags, in ``vllm serve``'s help groups; vLLM's flags where paged-serve
    does the same, and a reasoned refusal for the rest (``paged_serve.server.vllm_flags``)."""
    parser = argparse.ArgumentParser(prog="paged-serve", description=__doc__)
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as vllm serve's positional argument (the same as --model)",
    )
    front = parser.add_argument_group("Frontend")
    front.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    front.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    front.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="refuse new requests with 503 while this many are waiting (default: no limit)",
    )
    front.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer KEY' on /v1 routes (repeat for several keys; "
        f"default: the {API_KEY_ENV} environment variable, if set)",
    )
    front.add_argument(
        "--no-dashboard",
        action="store_true",
        help="do not serve the dashboard page (GET /) and its state endpoint /v1/engine/state",
    )
    front.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, used instead of the model's",
    )
    front.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vllm serve's launch lines: tool_choice auto is always on, with the "
        "--tool-call-parser (or the one chosen from the chat template)",
    )
    front.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(PARSERS),
        help="how tool calls are read from a reply under tool_choice auto (default: chosen "
        "from the chat template; generic for a template without tools)",
    )
    front.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="move the model's <think> block out of content into reasoning_content",
    )
    front.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for vllm serve's launch lines: requests are never logged",
    )
    front.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted for vllm serve's launch lines: no periodic stats are logged "
        "(/metrics and the dashboard have them)",
    )
    front.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    front.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["debug", "info", "warning", "error", "critical", "trace"],
        help="the HTTP access log's level (vllm serve's name; aiohttp serves here; trace is debug)",
    )
    groups = add_engine_args(parser)
    model = groups["ModelConfig"]
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model ids clients may use; replies and /metrics carry the first "
        "(default: the model's)",
    )
    model.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves out: auto (the model's "
        "generation_config.json), vllm (none: OpenAI's), or a folder with a "
        "generation_config.json (default auto)",
    )
    model.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help="most logprobs/top_logprobs/prompt_logprobs alternatives a request may ask for "
        "(400 beyond; at most %(default)s)",
    )
    model.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed the draws of requests that give no seed, so a run is reproducible "
        "(default: seeds from the OS)",
    )
    _add_limit_args(parser)
    _add_media_args(parser)
    add_refused_args(parser)
    return parser


def _add_media_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's image-input flags (``MediaConfig``; docs/api.md, "Image inputs")."""
    group = parser.add_argument_group("image inputs")
    group.add_argument(
        "--allowed-local-media-path",
        type=Path,
        default=None,
        metavar="DIR",
        help="the folder file:// image URLs may read under (default: no file URLs)",
    )
    group.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="the hosts http(s):// image URLs may be fetched from (default: none)",
    )
    group.add_argument(
        "--limit-mm-per-prompt",
        type=_image_limit,
        default=DEFAULT_MAX_IMAGES,
        metavar="JSON",
        help="images per prompt, as vLLM's JSON: '{\"image\": 4}' (default %(default)s)",
    )


def _image_limit(value: str) -> int:
    try:
        return image_limit(value)
    except ValueError as exc:  # argparse prints an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from None


def media_from_args(args: argparse.Namespace) -> MediaConfig:
    """The image-input flags as ``MediaConfig``."""
    return MediaConfig(
        local_path=args.allowed_local_media_path,
        domains=tuple(args.allowed_media_domains),
        max_images=args.limit_mm_per_prompt,
    )


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The ``ServerLimits`` flags (docs/reliability.md, "Limits")."""
    default = ServerLimits()
    group = parser.add_argument_group("limits")
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=default.max_request_bytes,
        help="largest request body accepted (413 beyond; default %(default)s)",
    )
    group.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=default.max_sequences_per_request,
        help="sequences one request may start, prompts x n (400 beyond; default %(default)s)",
    )
    group.add_argument(
        "--max-stored-responses",
        type=int,
        default=default.max_stored_responses,
        help="entries in the in-memory LRU store behind GET /v1/responses/{id} "
        "(default %(default)s)",
    )
    group.add_argument(
        "--max-response-store-bytes",
        type=int,
        default=default.max_response_store_bytes,
        help="bytes of JSON that store may hold, least recently used evicted first "
        "(default %(default)s)",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=default.header_timeout_s,
        help="seconds a connection has to send a complete request head, from when it opens or "
        "its last response ended; also the idle keep-alive timeout (default %(default)s)",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=default.body_timeout_s,
        help="seconds a request has to send its whole body (408 beyond; default %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=default.max_connections,
        help="open connections; at the cap a new one closes the longest-idle one, or gets 503 "
        "if all are running requests (default %(default)s)",
    )
    group.add_argument(
        "--write-timeout",
        type=float,
        default=default.write_timeout_s,
        help="seconds a response write may wait on a client that takes none of it; then the "
        "connection is closed and its requests aborted (default %(default)s)",
    )
    group.add_argument(
        "--max-unsent-bytes",
        type=int,
        default=default.max_unsent_bytes,
        help="bytes of a stream produced but not yet taken by its client; beyond, its requests "
        "are aborted and the connection closed (default %(default)s)",
    )
    group.add_argument(
        "--max-prompt-logprob-entries",
        type=int,
        default=default.max_prompt_logprob_entries,
        help="entries a reply's prompt_logprobs may hold, prompt tokens x (prompt_logprobs + 1) "
        "over its choices (400 beyond; default %(default)s)",
    )
    group.add_argument(
        "--max-background-responses",
        type=int,
        default=default.max_background_responses,
        help="unfinished background Responses runs, all keys together (503 beyond; default "
        "%(default)s)",
    )
    group.add_argument(
        "--max-background-responses-per-key",
        type=int,
        default=default.max_background_responses_per_key,
        help="unfinished background Responses runs one API key may hold (429 beyond; default "
        "%(default)s)",
    )
    group.add_argument(
        "--allowed-hosts",
        type=_host_list,
        default=default.allowed_hosts,
        metavar="NAMES",
        help="comma-separated host names a request's Host may carry besides localhost and "
        "loopback addresses when serving on loopback, and Origin hosts trusted besides the "
        "server's own; '*' turns both checks off (default: none)",
    )


def _host_list(value: str) -> tuple[str, ...]:
    """``--allowed-hosts a.example,b.example`` as a tuple of names."""
    return tuple(name for name in value.split(",") if name.strip())


# ServerLimits field -> its flag
LIMIT_FLAGS = {
    "max_request_bytes": "--max-request-bytes",
    "max_sequences_per_request": "--max-sequences-per-request",
    "max_stored_responses": "--max-stored-responses",
    "max_response_store_bytes": "--max-response-store-bytes",
    "header_timeout_s": "--header-timeout",
    "body_timeout_s": "--body-timeout",
    "max_connections": "--max-connections",
    "write_timeout_s": "--write-timeout",
    "max_unsent_bytes": "--max-unsent-bytes",
    "max_prompt_logprob_entries": "--max-prompt-logprob-entries",
    "max_logprobs": "--max-logprobs",
    "max_background_responses": "--max-background-responses",
    "max_background_responses_per_key": "--max-background-responses-per-key",
    "allowed_hosts": "--allowed-hosts",
}


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The flags as ``ServerLimits``; a bad value is a ValueError that names its flag."""
    values = {f: getattr(args, flag[2:].replace("-", "_")) for f, flag in LIMIT_FLAGS.items()}
    try:
        return ServerLimits(**values)
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        raise ValueError(f"{LIMIT_FLAGS.get(field, field)} {rest}") from None


def _check_fd_limit(max_connections: int) -> None:
    """Warn when the open-file limit would be reached before the connection cap (new
    connections would then fail to be accepted instead of displacing idle ones)."""
    try:
        import resource  # Unix only
    except ImportError:
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    headroom = 64  # model files, the listening socket, logs
    if soft != resource.RLIM_INFINITY and max_connections + headroom > soft:
        logger.warning(
            "--max-connections %d is close to the open-file limit %d (ulimit -n): lower it or "
            "raise the limit",
            max_connections,
            soft,
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or "" (every interface)
        return False


def _log_dashboard(url: str, host: str, keyed: bool) -> None:
    """The dashboard's URL; a warning when it is reachable beyond this machine."""
    logger.info("dashboard at %s", url)
    if not _is_loopback(host):
        logger.warning(
            "the dashboard is served wherever the API is (--host %s), so beyond this machine;"
            " %s; --no-dashboard turns it off",
            host,
            "its engine state needs an API key"
            if keyed
            else "without --api-key anyone who reaches the server can read its engine state",
        )


async def _watch_engine(engine: AsyncEngine, stop: asyncio.Event) -> None:
    """Set ``stop`` once the engine has died."""
    while engine.is_alive:
        await asyncio.sleep(ENGINE_WATCH_S)
    for _ in range(int(ENGINE_DEATH_REPORT_S / ENGINE_WATCH_S)):
        if engine.dead is not None:
            break
        await asyncio.sleep(ENGINE_WATCH_S)
    cause = engine.dead or "a tensor-parallel worker exited"
    logger.error("the engine died (%s): shutting down", cause)
    stop.set()


async def serve(
    engine: AsyncEngine,
    args: argparse.Namespace,
    limits: ServerLimits,
    sampling_defaults: SamplingDefaults = NO_DEFAULTS,
) -> bool:
    """Serve until SIGINT or SIGTERM (True), or until the engine dies (False); then shut down
    cleanly."""
    app = create_app(
        engine,
        served_model_name=args.served_model_name,
        api_keys=args.api_key,
        limits=limits,
        dashboard=not args.no_dashboard,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        sampling_defaults=sampling_defaults,
        media=media_from_args(args),
    )
    _check_fd_limit(limits.max_connections)
    runner = make_runner(app)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        snap = engine.snapshot()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens; max model len %d",
            snap.kv_blocks_total,
            engine.block_size,
            snap.kv_blocks_total * engine.block_size,
            engine.max_model_len,
        )
        host, port = runner.addresses[0][:2]
        host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
        logger.info("serving %s at http://%s:%d/v1", app[STATE].served_model_name, host, port)
        if not args.no_dashboard:
            _log_dashboard(f"http://{host}:{port}/", args.host, bool(args.api_key))
        watch = asyncio.create_task(_watch_engine(engine, stop))
        await stop.wait()
        watch.cancel()
        logger.info("shutting down")
    finally:
        await runner.cleanup()
    return engine.is_alive


def _chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it names no file."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long template is not a valid file name
        pass
    if "{" not in value:
        raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template")
    return value


def _configure_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.uvicorn_log_level is not None:
        level = {"trace": "DEBUG", "critical": "CRITICAL"}.get(args.uvicorn_log_level)
        logging.getLogger("aiohttp.access").setLevel(level or args.uvicorn_log_level.upper())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.max_waiting is not None and args.max_waiting < 0:
        parser.error("--max-waiting must be >= 0")
    try:
        limits = limits_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.api_key and os.environ.get(API_KEY_ENV):
        args.api_key = [os.environ[API_KEY_ENV]]
    if any(not key for key in args.api_key):
        parser.error("--api-key must not be empty")
    if args.served_model_name is not None and not all(args.served_model_name):
        parser.error("--served-model-name must not be empty")
    source = args.generation_config
    if source not in SOURCES and not Path(source).is_dir():
        parser.error(f"--generation-config {source}: not auto, vllm or a folder")
    try:
        template = _chat_template(args.chat_template) if args.chat_template else None
    except ValueError as exc:
        parser.error(str(exc))
    try:
        kwargs = engine_kwargs(args)
    except ValueError as exc:
        parser.error(str(exc))
    _configure_logging(args)
    try:
        config = EngineConfig(model=args.model, seed=args.seed, **kwargs)
        engine = AsyncEngine(config, max_waiting=args.max_waiting)
    except (ValueError, OSError, TensorParallelError) as exc:
        logger.error("cannot start the engine: %s", exc)
        return 2
    try:
        defaults = load_sampling_defaults(source, engine.generation_config)
        if template is not None:
            set_chat_template(engine, template)
        if defaults.values():
            logger.info(
                "sampling defaults from --generation-config %s: %s", source, defaults.values()
            )
        healthy = asyncio.run(serve(engine, args, limits, defaults))
    except ValueError as exc:
        logger.error("cannot start the server: %s", exc)
        return 2
    except OSError as exc:  # the address is in use, or not ours to bind
        logger.error("cannot serve on %s:%d: %s", args.host, args.port, exc)
        return 1
    finally:
        engine.shutdown()
    logger.info("stopped")
    return 0 if healthy else 1


def set_chat_template(engine: AsyncEngine, template: str) -> None:
    """Use ``template`` for every chat and Responses prompt (a ValueError without a
    tokenizer)."""
    if engine.tokenizer is None:
        raise ValueError("--chat-template needs the model's tokenizer, and this model has none")
    engine.tokenizer.chat_template = template


if __name__ == "__main__":
    sys.exit(main())
