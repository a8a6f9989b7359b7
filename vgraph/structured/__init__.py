"""Structured outputs: constrain what a request may generate to a JSON schema, any JSON object,
a regular expression, one of a list of strings, or a Lark grammar.

``params`` holds the request-side description (no heavy imports: ``SamplingParams`` uses it);
``compiler`` turns one into a grammar with llguidance (imported lazily) and caches it;
``matcher`` is the per-sequence state that advances on each accepted token; ``bitmask`` builds
the batch's allowed-token masks and applies them to the logits in one batched op.
"""
from .params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams"]
