"""The wire: every request body, reply object and stream chunk as a msgspec Struct, by endpoint.

``decode`` reads a body into its Struct (the first layer of validation: field types and ranges,
``field_types``); each request Struct's ``check()`` holds the rules between its fields;
``errors`` is the OpenAI error object every failure sends. Field names follow the OpenAI API
reference, plus vLLM's extras.

This package imports no server logic (only msgspec, the standard library and a few of the
engine's public constants and types): what the server does with a request lives beside it, in
``paged_serve.server``.
"""
