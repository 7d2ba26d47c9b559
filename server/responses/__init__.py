"""The Responses API: the handlers of ``/v1/responses`` (``handlers``), one reply's Response
object (``reply``) and its stream of events (``stream``), background runs (``background``), the
store of finished responses (``store``), and function tools mapped onto the chat tools
(``tools``)."""
