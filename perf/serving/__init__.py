"""Serving benchmarks: requests sent over HTTP to an OpenAI-compatible server, paged-serve's own
or llama.cpp's ``llama-server`` as the comparator.

* ``bench_serving.py``: streaming completions through each system's server, after a correctness
  check; its parts are ``workloads.py`` (the request mixes), ``client.py`` (the aiohttp client
  and its per-chunk timestamps), ``check.py`` (the replies against Hugging Face greedy),
  ``metrics.py`` (throughput, TTFT, ITL as vLLM's ``bench serve`` computes them),
  ``systems.py`` (starting and stopping the servers) and ``llama_cpp.py`` (building llama.cpp).
* ``bench_spec.py``: speculative decoding through the server, against llama.cpp's n-gram
  drafting.
* ``bench_moe_serving.py``: bench_serving on random mixture-of-experts models (Qwen3-MoE,
  Mixtral) written as Hugging Face folders by ``random_moe.py``, llama.cpp serving the GGUF its
  own converter makes of the same folder.
* ``load_test.py``: concurrent streaming clients that hang up at random (``tests/reliability``
  runs it small).
* ``bench_grammar_isolation.py``: how much one costly output constraint slows a plain request
  beside it on a running server.
* ``bench_tool_stream.py``: the event-loop cost of parsing a streamed reply for tool calls.

Every file is a command-line program or its part (``python -m perf.serving.bench_serving``);
none is collected by ``pytest perf/``.
"""
