"""Which grammar library kubeshard uses for structured output: xgrammar, llguidance and
outlines-core, measured side by side on this machine (run with all three installed; only
the chosen one is a dependency of the shard server).

For each library and tokenizer (the tiny demo model's 1k vocabulary and SmolLM2's 49k):
  * coverage: which of a fixed set of JSON schemas and regexes it compiles at all;
  * compile time of each (cold: a fresh compiler per grammar);
  * per-token time to compute the next-token mask and advance, walking the tokens of a
    valid instance (what the engine pays per constrained row and step).

    PYTHONPATH=<dir with the three libraries> python -m bench.grammar_libs [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import RESULTS

SCHEMAS = {
    "flat object": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False},
                    {"name": "Ada Lovelace", "age": 36}),
    "enum + array": ({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
        "required": ["color", "tags"]},
        {"color": "green", "tags": ["a", "bb"]}),
    "nested $defs/$ref": ({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                                  "y": {"type": "number"}},
                                               "required": ["x", "y"]}},
                           "type": "object", "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/point"}}},
                           "required": ["path"]},
                          {"path": [{"x": 1.5, "y": -2}, {"x": 0, "y": 3.25}]}),
    "anyOf + null": ({"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                                                       "note": {"type": "string", "maxLength": 12}},
                      "required": ["value", "note"]},
                     {"value": None, "note": "nothing"}),
    "string pattern + bounds": ({"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "n": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["zip", "n"]},
        {"zip": "12345", "n": 7}),
    "recursive tree": ({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"]}}, "$ref": "#/$defs/node"},
        {"v": 1, "kids": [{"v": 2, "kids": []}]}),
    "any JSON object": ({"type": "object"}, {"k": [1, {"x": "y"}], "z": True}),
    "format date-time + email": ({"type": "object", "properties": {
        "at": {"type": "string", "format": "date-time"}, "mail": {"type": "string", "format": "email"}},
        "required": ["at", "mail"]}, {"at": "2024-01-02T03:04:05Z", "mail": "a@b.io"}),
    "oneOf + const": ({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                                  "required": ["kind", "x"]},
                                 {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string"}},
                                  "required": ["kind", "y"]}]},
                      {"kind": "b", "y": "z"}),
    "prefixItems tuple": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                           "items": False}, ["a", 1]),
}
REGEXES = {
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
    "ipv4": (r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)", "192.168.10.254"),
}


def _tokenizers() -> dict[str, Path]:
    from kubeshard_shard.demo_model import cached_demo_model
    from kubeshard_shard.paths import cache_root

    out = {"demo tiny (1k)": cached_demo_model(cache_root() / "demo-models", arch="llama", size="tiny", seed=0)}
    smol = sorted((cache_root() / "models").glob("SmolLM2-135M*"))
    if smol:
        out["SmolLM2 (49k)"] = smol[0]
    return out


class Lib:
    name = ""

    def prepare(self, model_dir: Path) -> None: ...

    def compile(self, kind: str, source: str): ...

    def walk(self, compiled, tokens: list[int]) -> float:
        """Seconds per token for mask + advance along ``tokens``."""


class LLGuidance(Lib):
    name = "llguidance"

    def prepare(self, model_dir):
        import llguidance
        import llguidance.torch as lt

        self.ll, self.lt = llguidance, lt
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        tok = json.loads((model_dir / "tokenizer.json").read_text())
        eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == config.get("eos_token"))
        self.tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), eos_token=eos)
        self.vocab = self.tok.vocab_size

    def compile(self, kind, source):
        g = self.ll.LLMatcher.grammar_from_json_schema(source) if kind == "json" else \
            self.ll.grammar_from("regex", source)
        m = self.ll.LLMatcher(self.tok, g)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def walk(self, m, tokens):
        mask = self.lt.allocate_token_bitmask(1, self.vocab)
        t0 = time.perf_counter()
        for t in tokens:
            self.lt.fill_next_token_bitmask(m, mask, 0)
            if not m.consume_token(t):
                raise ValueError(f"rejected a valid token: {m.get_error()}")
        return (time.perf_counter() - t0) / len(tokens)


class XGrammar(Lib):
    name = "xgrammar"

    def prepare(self, model_dir):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        hf.eos_token = config.get("eos_token")
        self.info = xgr.TokenizerInfo.from_huggingface(hf)
        self.vocab = self.info.vocab_size

    def compile(self, kind, source):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        cg = compiler.compile_json_schema(source) if kind == "json" else compiler.compile_regex(source)
        return cg

    def walk(self, cg, tokens):
        m = self.xgr.GrammarMatcher(cg)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        t0 = time.perf_counter()
        for t in tokens:
            m.fill_next_token_bitmask(mask, 0)
            if not m.accept_token(t):
                raise ValueError("rejected a valid token")
        return (time.perf_counter() - t0) / len(tokens)


class OutlinesCore(Lib):
    name = "outlines-core"

    def prepare(self, model_dir):
        import outlines_core as oc
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

        self.oc = oc
        tok = json.loads((model_dir / "tokenizer.json").read_text())
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
        eos = specials[config.get("eos_token")]
        inverse = {c: b for b, c in bytes_to_unicode().items()}
        vocab: dict[bytes, list[int]] = {}
        for token, tid in tok["model"]["vocab"].items():
            if token in specials:
                continue
            vocab.setdefault(bytes(inverse[c] for c in token), []).append(tid)
        self.vocabulary = oc.Vocabulary(eos, vocab)
        self.vocab = max(tid for ids in vocab.values() for tid in ids) + 1
        self.vocab = max(self.vocab, eos + 1)

    def compile(self, kind, source):
        regex = self.oc.json_schema.build_regex_from_schema(source) if kind == "json" else source
        return self.oc.Index(regex, self.vocabulary)

    def walk(self, index, tokens):
        import torch

        guide = self.oc.Guide(index)
        mask = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)
        t0 = time.perf_counter()
        for t in tokens:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            guide.advance(t)
        return (time.perf_counter() - t0) / len(tokens)


def run(out: Path) -> None:
    from tokenizers import Tokenizer

    libs = [LLGuidance(), XGrammar(), OutlinesCore()]
    lines = ["# Grammar libraries for structured output (kubeshard chooses one)", "",
             f"`{' '.join(['python -m bench.grammar_libs'] + sys.argv[1:])}` — every figure below comes from one run, "
             "side by side on this machine. Per token: mask + advance on one matcher (median over the "
             "grammars it compiled); compile: a fresh compiler per grammar.", ""]
    cases = [("json", name, json.dumps(schema), json.dumps(instance)) for name, (schema, instance) in SCHEMAS.items()]
    cases += [("regex", name, rx, text) for name, (rx, text) in REGEXES.items()]
    for tok_name, model_dir in _tokenizers().items():
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        lines += [f"## {tok_name}", "",
                  "| grammar | " + " | ".join(f"{lib.name} compile ms / µs per token" for lib in libs) + " |",
                  "|---|" + "---|" * len(libs)]
        per_lib: dict[str, list[float]] = {lib.name: [] for lib in libs}
        compiles: dict[str, list[float]] = {lib.name: [] for lib in libs}
        failures: dict[str, int] = {lib.name: 0 for lib in libs}
        for lib in libs:
            lib.prepare(model_dir)
        for kind, name, source, instance in cases:
            tokens = tokenizer.encode(instance, add_special_tokens=False).ids
            cells = []
            for lib in libs:
                try:
                    t0 = time.perf_counter()
                    compiled = lib.compile(kind, source)
                    compile_ms = (time.perf_counter() - t0) * 1e3
                    per_tok = lib.walk(compiled, tokens) * 1e6
                    compiles[lib.name].append(compile_ms)
                    per_lib[lib.name].append(per_tok)
                    cells.append(f"{compile_ms:.1f} / {per_tok:.0f}")
                except Exception as exc:  # coverage is what we measure
                    failures[lib.name] += 1
                    cells.append(f"fails: {str(exc).splitlines()[0][:60]}")
            lines.append(f"| {kind}: {name} | " + " | ".join(cells) + " |")
        lines += ["", "| library | compiled | median compile ms | median µs per token |", "|---|---|---|---|"]
        for lib in libs:
            ok = len(cases) - failures[lib.name]
            med_c = statistics.median(compiles[lib.name]) if compiles[lib.name] else float("nan")
            med_t = statistics.median(per_lib[lib.name]) if per_lib[lib.name] else float("nan")
            lines.append(f"| {lib.name} | {ok}/{len(cases)} | {med_c:.1f} | {med_t:.0f} |")
        lines.append("")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar_libs.md")
    run(parser.parse_args().out)


if __name__ == "__main__":
    main()
