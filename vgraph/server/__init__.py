"""vgraph's OpenAI-compatible HTTP server (FastAPI + uvicorn) over an ``engine.client.EngineClient``:
the engine in the engine-core process or, with ``--engine-in-process``, on a thread of the server.

``app.build_app`` assembles the application; ``lifecycle.serve`` runs it as a process
(``vgraph serve``). Modules: ``protocol`` (request bodies), ``body`` (reading them safely),
``limits`` (what one request may ask), ``tokenization`` (the routes' tokenizer, off the event
loop when inputs are large), ``routes_*`` (endpoints), ``streaming`` (SSE and deltas),
``logprobs``, ``metrics`` (Prometheus), ``auth`` (``--api-key``), ``errors`` (OpenAI's error
shape), ``state`` (what routes share).
"""
from __future__ import annotations

from .state import ServerSettings

__all__ = ["ServerSettings"]
