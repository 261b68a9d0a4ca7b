"""Why a sequence ends at the token it just emitted: its end-of-sequence token, a stop
token id, a stop string in the text, or its length. One rule set for every engine of the
shard server (kubeshard's own and ONNX Runtime GenAI's); a grammar's own end is the
caller's business."""

from __future__ import annotations

from typing import Collection

from kubeshard_shard.engine.sequence import FinishReason, SamplingParams


def stop_reason(params: SamplingParams, eos_ids: Collection[int], generated: int, token_id: int, text: str,
                detok_text: str, max_stop_len: int, early: bool = False) -> FinishReason | None:
    """``generated`` tokens so far (this one included); ``text`` is what this token added
    to ``detok_text``; ``early``: before ``min_new_tokens`` only the length ends it."""
    if not early:
        if token_id in eos_ids and not params.ignore_eos:
            return FinishReason.EOS_TOKEN
        if token_id in params.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if params.stop_sequences and text:
            tail = detok_text[-(max_stop_len + len(text)):]
            if any(s in tail for s in params.stop_sequences):
                return FinishReason.STOP_SEQUENCE
    if generated >= params.max_new_tokens:
        return FinishReason.LENGTH
    return None
