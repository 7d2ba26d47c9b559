"""The OpenAI- and vLLM-compatible endpoints besides the Responses API: completions
(``completions``) and chat completions (``chat``) over their shared reply envelope (``reply``),
the tokenizer routes (``tokenize``), the model cards (``models``) and ``/metrics``
(``metrics``)."""
