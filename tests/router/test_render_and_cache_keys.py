"""Pure pieces: OpenAI stop trimming, cache entry encoding, cache keys and Cache-Control."""

from __future__ import annotations

from kubeshard_proto import pb
from kubeshard_router.cache import CacheControl, cache_key, decode_tokens, encode_tokens
from kubeshard_router.engine_request import EngineRequest
from kubeshard_router.openai_render import StopTrimmer, trim_stop


def stream(trimmer: StopTrimmer, pieces: list[str], stopped: bool) -> str:
    out = [trimmer.feed(p) for p in pieces[:-1]]
    out.append(trimmer.finish(pieces[-1], stopped))
    return "".join(out)


def test_stop_string_spread_over_tokens_is_never_streamed():
    t = StopTrimmer(("END",))
    emitted = [t.feed(" the"), t.feed(" E"), t.feed("N")]
    assert emitted == [" the", " ", ""]  # "E", "EN" could start "END": held back
    assert t.finish("D", stopped=True) == ""


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    t = StopTrimmer(("END",))
    assert t.feed(" E") == " "
    assert t.feed("x") == "Ex"
    assert stream(StopTrimmer(("END",)), [" a", " E", "N", "d"], stopped=False) == " a ENd"


def test_streamed_and_whole_text_agree():
    pieces = [" one", " two", " st", "op"]
    full = "".join(pieces)
    finish = pb.FinishDetails(reason=pb.FINISH_REASON_STOP_SEQUENCE)
    assert stream(StopTrimmer(("stop", "x")), pieces, stopped=True) == " one two "
    assert trim_stop(full, ("stop", "x"), finish) == " one two "
    length = pb.FinishDetails(reason=pb.FINISH_REASON_LENGTH)
    assert trim_stop(full, ("stop",), length) == full  # not stopped: nothing trimmed
    assert stream(StopTrimmer(()), pieces, stopped=False) == full


def test_longest_matching_stop_is_removed():
    assert StopTrimmer(("b", "ab")).finish("xxab", stopped=True) == "xx"


def tokens() -> list[pb.Token]:
    first = pb.Token(id=5, text="é", logprob=-0.5, index=0)
    first.prefill.add(id=1, text="<s>")
    first.top_tokens.add(id=6, text="x", logprob=-1.0)
    last = pb.Token(id=2, text="</s>", special=True, index=1)
    last.finish.CopyFrom(pb.FinishDetails(reason=pb.FINISH_REASON_EOS_TOKEN, generated_tokens=2, seed=9))
    return [first, last]


def test_cache_entry_round_trip_and_corruption():
    blob = encode_tokens(tokens())
    assert decode_tokens(blob) == tokens()
    assert decode_tokens(b"garbage") is None
    assert decode_tokens(blob[:-3]) is None  # truncated: unreadable, treated as a miss
    assert decode_tokens(encode_tokens(tokens()[:1])) is None  # no finish: never replayed


def test_cache_keys_are_namespaced_and_cover_what_decides_the_output():
    req = EngineRequest(input_ids=[1, 2, 3], max_new_tokens=8)
    key = cache_key("demo", "r1", req)
    assert key.startswith("kubeshard:demo:r1:cache:")
    assert cache_key("other", "r1", req) != key
    assert cache_key("demo", "r2", req) != key
    assert cache_key("demo", "r1", EngineRequest(input_ids=[1, 2, 3], max_new_tokens=8)) == key
    for change in (dict(input_ids=[1, 2, 4]), dict(max_new_tokens=9), dict(stop=("x",)),
                   dict(top_n_tokens=2), dict(repetition_penalty=1.1), dict(prefill_details=True),
                   dict(do_sample=True, seed=1)):
        other = EngineRequest(**{**dict(input_ids=[1, 2, 3], max_new_tokens=8), **change})
        assert cache_key("demo", "r1", other) != key, change
    # Sampling knobs do not matter to a greedy request.
    assert cache_key("demo", "r1", EngineRequest(input_ids=[1, 2, 3], max_new_tokens=8, temperature=0.3)) == key


def test_only_greedy_or_seeded_requests_are_deterministic():
    assert EngineRequest(input_ids=[1], max_new_tokens=1).deterministic
    assert EngineRequest(input_ids=[1], max_new_tokens=1, do_sample=True, seed=0).deterministic
    assert not EngineRequest(input_ids=[1], max_new_tokens=1, do_sample=True).deterministic


def test_cache_control_directives():
    assert (CacheControl(None).read, CacheControl(None).write) == (True, True)
    assert (CacheControl("no-cache").read, CacheControl("no-cache").write) == (False, True)
    assert (CacheControl("max-age=0, No-Store").read, CacheControl("no-store").write) == (False, False)
