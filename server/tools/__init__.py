"""Function tools and what is read out of a reply: the plan for a request's tools
(``planning.plan_tools``, the one entry point: template messages, the grammar ``tool_choice``
imposes, how the reply is parsed), the grammar (``grammar``), the parsers of each model family
(``parsers``) over JSON still being written (``json_prefix``), calls streamed as they are written
(``streaming``), and reasoning split out of the content (``reasoning``)."""
