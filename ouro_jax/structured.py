"""Structured outputs: a grammar constrains each next token through a packed bitmask.

    GuidedDecoding (kind, spec)      what a request asks for; checked when it is made
         |  GrammarCompiler.matcher()   one compile per (vocabulary, spec), LRU; a copy per request
         v
    GrammarMatcher.fill_bitmask(out, row)   host: int32 words, bit t of word t // 32 = token t allowed
         |                                  (computed for step n+1 while the device runs step n)
         v
    apply_token_bitmask(logits, bitmask)    device, inside the compiled step: disallowed -> -inf
         |
    GrammarMatcher.accept(token)            host, once the sampled token is back

The grammar engine is llguidance (docs/decisions.md, "Structured outputs"), imported on first use so
that ``import ouro_jax`` does not need it. JSON is compact unless asked otherwise: no whitespace
between tokens, so a weak model cannot loop on it.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import jax.numpy as jnp
import numpy as np

__all__ = [
    "GUIDED_KINDS",
    "GuidedDecoding",
    "GrammarCompiler",
    "GrammarMatcher",
    "bitmask_words",
    "new_bitmask",
    "fill_bitmask_rows",
    "apply_token_bitmask",
    "apply_token_bitmask_reference",
]

GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row: one bit per token id of the model's vocabulary."""
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """``[rows, bitmask_words(vocab_size)]`` int32, every token allowed (an unconstrained row)."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


@dataclass(frozen=True)
class GuidedDecoding:
    """One constraint on a request's output. ``spec`` is the JSON schema as canonical JSON text
    (json_schema), the regex (regex), a JSON list of strings (choice), a Lark or GBNF grammar
    (grammar), empty for json_object. Build it with the class methods; an invalid spec raises
    ``ValueError`` here, before any request runs."""

    kind: str
    spec: str = ""
    compact_json: bool = True

    def __post_init__(self):
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided decoding kind must be one of {GUIDED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"guided decoding spec must be a string, got {type(self.spec).__name__}")
        _grammar_text(self)  # validates and caches the grammar

    @classmethod
    def json_schema(cls, schema: dict | str, compact_json: bool = True) -> GuidedDecoding:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"JSON schema must be a JSON object, got {type(schema).__name__}")
        # canonical text, keys kept in order (properties are generated in schema order)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), compact_json)

    @classmethod
    def json_object(cls, compact_json: bool = True) -> GuidedDecoding:
        return cls("json_object", "", compact_json)

    @classmethod
    def regex(cls, pattern: str) -> GuidedDecoding:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GuidedDecoding:
        if isinstance(options, str) or not options or not all(isinstance(o, str) for o in options):
            raise ValueError(f"choice needs a non-empty list of strings, got {options!r}")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> GuidedDecoding:
        return cls("grammar", text)


@functools.lru_cache(maxsize=256)
def _grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar of a constraint (tokenizer-free); ``ValueError`` naming the problem."""
    import llguidance

    M = llguidance.LLMatcher
    # compact: no free whitespace and the tightest separators
    json_options = {"whitespace_flexible": not guided.compact_json, "item_separator": ",", "key_separator": ":"}
    if guided.kind == "json_schema":
        grammar = M.grammar_from_json_schema(guided.spec, overrides=json_options)
    elif guided.kind == "json_object":
        grammar = M.grammar_from_json_schema({"type": "object"}, overrides=json_options)
    elif guided.kind == "regex":
        grammar = M.grammar_from_regex(guided.spec)
    elif guided.kind == "choice":
        grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(guided.spec)))
    else:
        try:
            grammar = llguidance.grammar_from("grammar", guided.spec)
        except ValueError as e:
            raise ValueError(f"invalid grammar: {e}") from None
    error = M.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {guided.kind.replace('_', ' ')}: {error.strip()}")
    return grammar


class GrammarCompiler:
    """Compiles constraints for one vocabulary: a grammar is compiled once per spec (LRU) and each
    request gets a cheap copy of the compiled matcher.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (or its JSON text); ``vocab_size`` is the model's,
    which may exceed the tokenizer's (padding ids are never allowed); ``eos_token_ids`` end a
    request and are allowed exactly when the grammar accepts."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], cache_size: int = 128):
        import llguidance

        text = tokenizer if isinstance(tokenizer, str) else tokenizer.to_str()
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("structured outputs need at least one EOS token id")
        eos = list(self.eos_token_ids)
        try:
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        except ValueError:  # a decoder llguidance does not read (a character tokenizer): its tokens' bytes
            if isinstance(tokenizer, str):
                raise
            wrapped = llguidance.TokenizerWrapper(_TokenBytes(tokenizer, eos[0]))
            self._tokenizer = llguidance.LLTokenizer(wrapped, n_vocab=self.vocab_size, eos_token=eos)
        self._compiled: OrderedDict[GuidedDecoding, object] = OrderedDict()
        self._cache_size = cache_size

    def matcher(self, guided: GuidedDecoding) -> GrammarMatcher:
        """A fresh matcher for one request."""
        template = self._compiled.get(guided)
        if template is None:
            import llguidance

            template = llguidance.LLMatcher(self._tokenizer, _grammar_text(guided), log_level=0)
            if template.is_error():
                raise ValueError(f"invalid {guided.kind.replace('_', ' ')}: {template.get_error()}")
            self._compiled[guided] = template
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(guided)
        return GrammarMatcher(template.deep_copy(), self.vocab_size)


class _TokenBytes:
    """A ``tokenizers.Tokenizer`` as ``llguidance.TokenizerWrapper`` reads one: each id's bytes
    (special tokens marked with the 0xFF byte llguidance reserves for them) and an encoder."""

    def __init__(self, tokenizer, eos_token_id: int):
        specials = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        self.tokens = [
            b"\xff" + specials[i].encode() if i in specials else tokenizer.decode([i]).encode() for i in range(n)
        ]
        self.eos_token_id, self.bos_token_id = eos_token_id, None
        self.special_token_ids = sorted(specials)
        self._tokenizer = tokenizer

    def __call__(self, s: str) -> list[int]:
        return self._tokenizer.encode(s, add_special_tokens=False).ids


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, out: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``out[row]`` (``out`` int32 ``[R, bitmask_words(V)]``,
        C-contiguous)."""
        words = bitmask_words(self.vocab_size)
        if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != words:
            raise ValueError(f"bitmask must be int32 [R, {words}], got {out.dtype} {out.shape}")
        words = out[row]
        if not words.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask rows must be C-contiguous")
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        return self._matcher.try_consume_tokens([int(token_id)]) == 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (for speculation)."""
        if not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def eos_allowed(self) -> bool:
        """The output so far is complete: EOS may end it here (the bitmask allows it then)."""
        return self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (or EOS was accepted): the request should stop now."""
        return self._matcher.is_stopped()


def fill_bitmask_rows(out: np.ndarray, rows: Sequence[tuple[GrammarMatcher, int]]) -> None:
    """``fill_bitmask`` for several (matcher, row) pairs of one step; rows not named keep their words."""
    for matcher, row in rows:
        matcher.fill_bitmask(out, row)


def _allowed(bitmask, vocab_size: int, xp):
    """``[R, W]`` int32 words -> ``[R, vocab_size]`` bool, bit ``t % 32`` of word ``t // 32``."""
    words = bitmask_words(vocab_size)
    if bitmask.shape[-1] != words:
        raise ValueError(f"bitmask has {bitmask.shape[-1]} words, vocab_size {vocab_size} needs {words}")
    bits = (bitmask[:, :, None] >> xp.arange(32, dtype=xp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_token_bitmask(logits: jnp.ndarray, bitmask: jnp.ndarray) -> jnp.ndarray:
    """``logits [R, V]`` (any float), ``bitmask [R, ceil(V/32)]`` int32 -> logits with disallowed
    tokens at -inf. Shapes are static: safe inside a jitted step."""
    return jnp.where(_allowed(bitmask, logits.shape[-1], jnp), logits, -jnp.inf)


def apply_token_bitmask_reference(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """numpy twin of ``apply_token_bitmask``."""
    return np.where(_allowed(np.asarray(bitmask), logits.shape[-1], np), logits, -np.inf).astype(logits.dtype)
