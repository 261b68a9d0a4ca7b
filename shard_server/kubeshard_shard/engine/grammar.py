"""Structured output: grammars compiled once per distinct constraint, matched per sequence.

The grammar library is xgrammar. ``bench/grammar_libs.py`` measured it beside llguidance
and outlines-core on this machine (``bench/results/grammar_libs.md``): all three compiled
every schema and regex of the set, but xgrammar computes a next-token mask in 4–18 µs
(median 6 µs on the demo vocabulary, 9 µs on SmolLM2's 49k) against llguidance's
24–765 µs and outlines-core's up to 1.3 ms (outlines-core also compiles a whole DFA up
front: 21–29 s for "any JSON object" on the 49k vocabulary). The mask is paid per
constrained row and step, so it decides the overhead at batch 16; compile time (xgrammar
~10 ms against llguidance's ~1 ms) is paid once per schema and cached here. xgrammar
also builds masks for JSON schema, regex, EBNF and structural tags (free text with
schema-checked sections: tool calls) behind one matcher type.

Only the leader samples, so grammars live there alone, whatever the sharding strategy.
Each step, ``fill`` writes the masks of the step's constrained rows into one bitmask that
the sampler applies to the whole batch in one call; unconstrained rows are untouched.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from kubeshard_shard.engine.request import RequestError
from kubeshard_shard.engine.sequence import GrammarSpec, Sequence

DEFAULT_CACHE_SIZE = 256


def _choice_ebnf(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise RequestError("grammar choice needs at least one non-empty string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.9 writes the characters of a length-bounded string (maxLength, minLength)
# as [^"\\\r\n], which lets raw control characters into a JSON string (invalid JSON,
# seen on the demo model); the unbounded string rule excludes \0-\x1f as JSON requires.
_LOOSE_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\]'


def json_schema_grammar(source: str):
    """The grammar of a JSON schema: compact separators (no free whitespace a model could
    loop on), strict (no properties the schema does not name)."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=True))
    return xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER))


def _compact_schemas(node):
    """A structural tag whose JSON-schema sections use ``json_schema_grammar`` (compact,
    strict, JSON-valid strings) instead of xgrammar's default (any whitespace)."""
    if isinstance(node, list):
        return [_compact_schemas(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node and node.get("style", "json") == "json":
        return {"type": "grammar", "grammar": str(json_schema_grammar(json.dumps(node["json_schema"])))}
    return {k: _compact_schemas(v) for k, v in node.items()}


class GrammarCache:
    """Compiles grammars for one model's tokenizer (thread-safe: the gRPC thread compiles
    while validating a request, the engine thread makes matchers)."""

    def __init__(self, tokenizer_json: bytes, eos_ids: frozenset[int], vocab_size: int,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer_json = tokenizer_json
        self._eos_ids = sorted(eos_ids)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self._tokenizer_json.decode("utf-8")))
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._eos_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def _compile(self, spec: GrammarSpec):
        compiler = self._get_compiler()
        kind, source = spec.kind, spec.source
        if kind == "json_schema":
            try:
                schema = json.loads(source)
            except json.JSONDecodeError as exc:
                raise RequestError(f"grammar: the JSON schema is not valid JSON ({exc})") from None
            if schema in ({}, True):
                return compiler.compile_builtin_json_grammar()
            return compiler.compile_grammar(json_schema_grammar(source))
        if kind == "regex":
            return compiler.compile_regex(source)
        if kind == "ebnf":
            return compiler.compile_grammar(source)
        if kind == "choice":
            return compiler.compile_grammar(_choice_ebnf(json.loads(source)))
        if kind == "structural_tag":
            try:
                tag = json.loads(source)
            except json.JSONDecodeError as exc:
                raise RequestError(f"grammar: the structural tag is not valid JSON ({exc})") from None
            return compiler.compile_structural_tag(json.dumps(_compact_schemas(tag)))
        raise RequestError(f"grammar kind {kind!r} is not supported")

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of ``spec``; RequestError when it does not compile."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        try:
            compiled = self._compile(spec)
        except RequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with its reason
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RequestError(f"grammar ({spec.kind}) does not compile: {first[:300]}") from None
        with self._lock:
            self.compiles += 1
            self._compiled[spec] = compiled
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))


class StepMasks:
    """Fills one bitmask per step for the constrained rows of a batch."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buffer = torch.empty(0)
        self._batch = None  # xgrammar's BatchGrammarMatcher, made on the first constrained step

    def bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask [rows, words] int32 of the step (one buffer, grown as batches grow)."""
        if self._buffer.shape[0] < rows:
            words = (self.vocab_size + 31) // 32
            self._buffer = torch.full((max(rows, 2 * self._buffer.shape[0]), words), -1, dtype=torch.int32)
        return self._buffer[:rows]

    def fill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask [len(seqs), words] int32, constrained row indices), or None."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        mask = self.bitmask(len(seqs))
        if self._batch is None:
            import xgrammar as xgr

            # one call for the step's rows (16 cheap masks: 6 us against 14 us one call each);
            # on one thread: two took 110 us (a pool's start and join per call, 2 cores)
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._batch.batch_fill_next_token_bitmask([seqs[i].matcher for i in rows], mask, rows)
        return mask, rows


def apply_masks(logits: torch.Tensor, mask: torch.Tensor, rows: list[int], kernels=None) -> None:
    """Sets the logits of every token a row's grammar forbids to -inf, for all the
    constrained rows in one call (on the logits' device): the CPU kernels' where they
    serve (``csrc/grammar_mask.cpp`` says why), else xgrammar's."""
    if (kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.is_contiguous()):
        kernels.apply_bitmask_(logits, mask, rows)
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    if mask.device != logits.device:
        mask = mask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(vocab, mask.shape[1] * 32), indices=rows)
