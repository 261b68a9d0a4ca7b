"""Incremental detokenization that never splits a multi-byte character.

Each new token is decoded together with a few tokens before it and only the text that
is stable is emitted: while the tail decodes to U+FFFD (an incomplete UTF-8 sequence),
nothing is emitted and a later token carries the character. A few prompt tokens give
the first output token its context (tokenizers that drop a leading space when a token
is decoded alone). The deltas concatenate to exactly the decoded output.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    """``skip_special_tokens`` False: a special token adds its own text (its content), set
    off by one space from the text around it when ``spaces_between_special_tokens``, as
    Hugging Face's decode joins the pieces around added tokens."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], special_ids: frozenset[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids = [t for t in prompt_ids[-PROMPT_CONTEXT:] if t not in special_ids]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text emitted so far
        self._space_next = False

    def _special(self, token_id: int) -> str:
        if self.skip_special_tokens:
            return ""
        held = self.flush()  # text held back before the special token comes out first
        delta = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if self.spaces_between_special_tokens:
            if self.text and not self.text.endswith(" "):
                delta = " " + delta
            self._space_next = True
        self.text += delta
        return held + delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token_id: int) -> str:
        """Returns the text this token adds (possibly empty)."""
        if token_id in self.special_ids:
            return self._special(token_id)
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith(REPLACEMENT) or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self._space_next:
            self._space_next = False
            if not delta.startswith(" "):
                delta = " " + delta
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (an incomplete
        character decodes to U+FFFD, as in the full decode)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
