"""Compiles ``StructuredOutputsParams`` into llguidance grammars, once per distinct spec.

Why llguidance: a self-contained Rust wheel with no Python dependencies (nothing to keep in
step with torch or triton, one file to carry to a machine that lacks it), JSON schema, regex
and Lark grammars in one engine, grammars that need no ahead-of-time compile over the
vocabulary (validation takes well under a millisecond; the token masks are computed lazily
per step in tens of microseconds), and the option to turn off free whitespace in JSON.

The compiler owns the llguidance tokenizer (built lazily from the model's tokenizer JSON, which
the engine captures at startup so no other thread's tokenizer object is ever touched) and a
bounded LRU cache of validated grammars. It is thread-safe: the server validates a request's
grammar on a worker thread before submitting it, so an invalid schema is a 400 before the
engine sees it, and the engine's own compile at ``add_request`` is then a cache hit.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from .params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256


def import_llguidance() -> Any:
    """The llguidance module, or a ValueError saying how to get it (structured outputs only)."""
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need the llguidance package, which is not installed: "
                         "pip install llguidance") from None
    return llguidance


def tokenizer_json(tokenizer: Any) -> Optional[str]:
    """The fast tokenizer's JSON (added tokens included, padding and truncation off), or None
    for a slow tokenizer. Taken by the compiler on its first grammar, not at start-up."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    import copy

    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar and the tokenizer it matches tokens of."""

    kind: str
    grammar: str
    tokenizer: Any  # llguidance.LLTokenizer
    compile_s: float

    def matcher(self) -> Any:
        """A fresh llguidance matcher at the grammar's start (one per sequence)."""
        llg = import_llguidance()
        return llg.LLMatcher(self.tokenizer, self.grammar, log_level=0)


class GrammarCompiler:
    """Validated grammars for a model's vocabulary, cached by spec (``StructuredOutputsParams.key``).

    ``vocab_size`` is the model's (its lm_head rows), which may exceed the tokenizer's length:
    the ids beyond the tokenizer have no text and are never allowed.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        # Serialized for llguidance only when a request first asks for a grammar: an engine
        # that never sees one does not pay for it at start-up (megabytes for a 150k vocabulary).
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def ll_tokenizer(self) -> Any:
        """The llguidance tokenizer, built on first use (milliseconds to a second, by vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                llg = import_llguidance()
                serialized = tokenizer_json(self._tokenizer)
                if serialized is None:
                    raise ValueError("structured outputs need a fast (Rust) tokenizer; this model's is not")
                if not self.eos_token_ids:
                    raise ValueError("structured outputs need an EOS token; the model defines none")
                self._ll_tokenizer = llg.LLTokenizer(serialized, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar of ``spec``; a ValueError naming the problem when it is invalid."""
        key = spec.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached
        tokenizer = self.ll_tokenizer()
        start = time.perf_counter()
        grammar = build_grammar(spec)
        error = import_llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"invalid structured output {spec.kind}: {error.strip()}")
        compiled = CompiledGrammar(spec.kind, grammar, tokenizer, time.perf_counter() - start)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


def build_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of ``spec`` (not validated yet)."""
    import json

    llg = import_llguidance()
    kind = spec.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": spec.whitespace_flexible}
        try:
            return llg.LLMatcher.grammar_from_json_schema(spec.schema, defaults=options)
        except ValueError as exc:
            raise ValueError(f"invalid structured output json: {exc}") from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":  # JSON string literals are Lark string literals
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice or []))
    return llg.LLMatcher.grammar_from_lark(spec.grammar)
