"""From a decoded request to running engine requests: prompts to token ids through the
tokenizer or chat template (``prompts``), request fields to the engine's ``SamplingParams``
(``sampling``, with the model's defaults, ``defaults``), output constraints (``structured``),
logprobs in the wire's shapes (``logprobs``), and one API call's engine requests started and read
together (``run``)."""
