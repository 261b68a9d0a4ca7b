"""OpenAI response shapes, built from the engine's tokens.

The engine keeps a matched stop sequence in its text; OpenAI does not. ``StopTrimmer``
holds back any streamed text that could be the start of a stop sequence, and drops the
sequence when the generation ends on it, so streamed and non-streamed text agree.
"""

from __future__ import annotations

from typing import Optional

from kubeshard_proto import pb

FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS_TOKEN: "stop",
          pb.FINISH_REASON_STOP_SEQUENCE: "stop", pb.FINISH_REASON_STOP_TOKEN: "stop"}


def stop_reason(finish: pb.FinishDetails, last: pb.Token, text: str, stops: tuple[str, ...]):
    """vLLM's ``stop_reason``: the stop token id or the stop string that ended a choice."""
    if finish.reason == pb.FINISH_REASON_STOP_TOKEN:
        return last.id
    if finish.reason == pb.FINISH_REASON_STOP_SEQUENCE:
        found = [s for s in stops if s in text]
        return max(found, key=lambda s: (text.rfind(s), len(s))) if found else None
    return None


def prompt_logprobs(first: pb.Token) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else
    ``{token id: {logprob, rank, decoded_token}}`` for the token and its alternatives."""
    out: list = []
    for i, p in enumerate(first.prefill):
        if i == 0 or not p.HasField("logprob"):
            out.append(None)
            continue
        entry = {str(p.id): {"logprob": p.logprob, "rank": None, "decoded_token": p.text}}
        for rank, alt in enumerate(p.top_tokens, 1):
            if alt.id == p.id:
                entry[str(p.id)]["rank"] = rank
            else:
                entry[str(alt.id)] = {"logprob": alt.logprob, "rank": rank, "decoded_token": alt.text}
        out.append(entry)
    return out


def split_sequences(tokens: list[pb.Token]) -> list[list[pb.Token]]:
    """A stream's tokens per sequence, in sequence order."""
    seqs: dict[int, list[pb.Token]] = {}
    for t in tokens:
        seqs.setdefault(t.sequence, []).append(t)
    return [seqs[i] for i in sorted(seqs)]


def best_sequences(tokens: list[pb.Token], n: int) -> list[list[pb.Token]]:
    """The ``n`` sequences with the highest cumulative logprob (best_of), likeliest first;
    all of them in order when there are only ``n``."""
    seqs = split_sequences(tokens)
    if len(seqs) <= n:
        return seqs
    return sorted(seqs, key=lambda s: -s[-1].finish.cumulative_logprob)[:n]


class StopTrimmer:
    """``keep``: the stop sequence stays in the text, only what follows it is dropped
    (vLLM's include_stop_str_in_output)."""

    def __init__(self, stops: tuple[str, ...], keep: bool = False) -> None:
        self.stops = stops
        self.keep = keep
        self.max_hold = max((len(s) for s in stops), default=1) - 1
        self.held = ""

    def feed(self, text: str) -> str:
        """Text that is safe to emit now."""
        if not self.stops:
            return text
        buf = self.held + text
        hold = 0
        for k in range(min(len(buf), self.max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def finish(self, text: str, stopped: bool) -> str:
        """The rest of the text once the generation ended (``stopped``: on a stop sequence)."""
        buf = self.held + text
        self.held = ""
        if stopped and self.stops:
            for s in sorted(self.stops, key=len, reverse=True):
                if buf.endswith(s):
                    return buf if self.keep else buf[: -len(s)]
            cut, stop = max((buf.rfind(s), s) for s in self.stops)
            if cut >= 0:
                return buf[:cut + len(stop)] if self.keep else buf[:cut]
        return buf


def trim_stop(text: str, stops: tuple[str, ...], finish: pb.FinishDetails, keep: bool = False) -> str:
    return StopTrimmer(stops, keep).finish(text, finish.reason == pb.FINISH_REASON_STOP_SEQUENCE)


def usage(prompt_tokens: int, generated: int, finish: Optional[pb.FinishDetails]) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
           "total_tokens": prompt_tokens + generated}
    if finish is not None:
        out["prompt_tokens_details"] = {"cached_tokens": finish.cached_prompt_tokens}
    return out


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprob(t: pb.Token) -> dict:
    return {"token": t.text, "logprob": t.logprob, "bytes": _bytes(t.text),
            "top_logprobs": [{"token": a.text, "logprob": a.logprob, "bytes": _bytes(a.text)}
                             for a in t.top_tokens]}


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, built token by token."""

    def __init__(self, offset: int = 0) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[Optional[float]] = []
        self.top_logprobs: list[Optional[dict[str, float]]] = []
        self.text_offset: list[int] = []
        self.offset = offset

    def add(self, text: str, logprob: Optional[float], top: Optional[dict[str, float]]) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def add_token(self, t: pb.Token) -> None:
        self.add(t.text, t.logprob, {a.text: a.logprob for a in t.top_tokens})

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
