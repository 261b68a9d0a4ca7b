"""Structured output in the engine: every constrained output parses and validates against
its JSON schema (``jsonschema``), matches its regex, or is one of its choices — for the
random demo model and the default real model (SmolLM2-135M-Instruct), alone and batched
with unconstrained requests, whose greedy output stays what it is alone."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest

from kubeshard_shard.engine.request import RequestError, make_sampling_params
from kubeshard_shard.engine.sequence import FinishReason, GrammarSpec
from tests.support.engine import build_engine, random_prompts, run_to_completion

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["color", "tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 10},
                                      "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]}},
     "required": ["ok", "score", "note"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}, "y": {"type": "integer"}},
                         "required": ["x", "y"]}},
     "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
]
REGEX = r"(\+1 )?\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


def schema_spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def params(grammar: GrammarSpec | None, n: int = 160, **kw):
    return make_sampling_params(max_new_tokens=n, grammar=grammar, **kw)


def text(served, outs) -> str:
    return served.tokenizer.decode([o.token_id for o in outs])


def check_all(served, prompts: list[list[int]]) -> None:
    """Each schema, the regex and the choice, greedy and sampled, all in one batch with
    unconstrained greedy requests; then the unconstrained ones alone."""
    specs = [schema_spec(s) for s in SCHEMAS] + [GrammarSpec("regex", REGEX), GrammarSpec("choice", json.dumps(CHOICES))]
    constrained = []
    for i, spec in enumerate(specs):
        constrained.append((prompts[i % len(prompts)], params(spec)))
        constrained.append((prompts[(i + 1) % len(prompts)], params(spec, do_sample=True, seed=i, temperature=1.0)))
    free = [(p, make_sampling_params(max_new_tokens=24, ignore_eos=True)) for p in prompts[:3]]
    batch = constrained[:5] + free + constrained[5:]
    outs = run_to_completion(served.engine, batch)
    free_outs, constrained_outs = outs[5:8], outs[:5] + outs[8:]
    for (_, p), got in zip(constrained, constrained_outs):
        assert got[-1].finish.reason is FinishReason.EOS_TOKEN, (p.grammar, text(served, got))
        value = text(served, got)
        spec = p.grammar
        if spec.kind == "json_schema":
            jsonschema.validate(json.loads(value), json.loads(spec.source))
        elif spec.kind == "regex":
            assert re.fullmatch(REGEX, value), value
        else:
            assert value in CHOICES, value
    alone = run_to_completion(served.engine, free)
    assert [[o.token_id for o in a] for a in alone] == [[o.token_id for o in f] for f in free_outs]


@pytest.fixture(scope="module")
def demo(demo_model):
    return build_engine(demo_model("llama"), max_total_tokens=512)


def test_constrained_outputs_validate_on_the_demo_model(demo):
    check_all(demo, random_prompts(4, 1000, (8, 40), seed=1))


def test_grammars_compile_once_and_bad_ones_name_the_grammar(demo):
    grammars = demo.engine.grammars
    spec = schema_spec(SCHEMAS[0])
    grammars.compile(spec)
    before = grammars.compiles
    run_to_completion(demo.engine, [([5, 6, 7], params(spec)), ([8, 9], params(spec))])
    assert grammars.compiles == before
    with pytest.raises(RequestError, match=r"grammar \(regex\) does not compile"):
        grammars.compile(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(RequestError, match=r"grammar: the JSON schema is not valid JSON"):
        grammars.compile(GrammarSpec("json_schema", "{nope"))


def test_a_constrained_request_ends_when_its_grammar_does_even_with_ignore_eos(demo):
    [outs] = run_to_completion(demo.engine, [([5, 6, 7], params(GrammarSpec("choice", '["yes", "no"]'),
                                                                   ignore_eos=True))])
    assert text(demo, outs) in ("yes", "no") and outs[-1].finish.reason is FinishReason.EOS_TOKEN


@functools.cache
def smol_folder():
    from kubeshard_shard.checkpoints import default_model_file, local_checkpoint

    return local_checkpoint(default_model_file())


@functools.cache
def smol_engine_and_prompts():
    served = build_engine(smol_folder(), max_total_tokens=512, kv="128MiB")
    tok = served.tokenizer
    config = json.loads((smol_folder() / "tokenizer_config.json").read_text())
    import jinja2

    template = jinja2.Template(config["chat_template"])
    questions = ["Describe a person as JSON.", "Give me a color and some tags.", "Rate this: great movie!",
                 "List two points."]
    prompts = [tok.encode(template.render(messages=[{"role": "user", "content": q}], add_generation_prompt=True),
                          add_special_tokens=False) for q in questions]
    return served, prompts


@pytest.mark.slow
def test_constrained_outputs_validate_on_the_default_model():
    check_all(*smol_engine_and_prompts())


@pytest.mark.slow
def test_constrained_requests_alone_validate_on_the_default_model():
    """Each schema (and the regex and the choice) as the only request in the engine, greedy:
    the 49k-token vocabulary's masks with nothing else in the batch."""
    served, prompts = smol_engine_and_prompts()
    for i, schema in enumerate(SCHEMAS):
        [outs] = run_to_completion(served.engine, [(prompts[i], params(schema_spec(schema)))])
        assert outs[-1].finish.reason is FinishReason.EOS_TOKEN, text(served, outs)
        jsonschema.validate(json.loads(text(served, outs)), schema)
    [outs] = run_to_completion(served.engine, [(prompts[0], params(GrammarSpec("regex", REGEX)))])
    assert re.fullmatch(REGEX, text(served, outs)), text(served, outs)
    [outs] = run_to_completion(served.engine, [(prompts[2], params(GrammarSpec("choice", json.dumps(CHOICES))))])
    assert text(served, outs) in CHOICES
