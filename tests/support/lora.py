"""PEFT LoRA adapters with random weights (fixed seeds), and transformers+peft's greedy
tokens with one, for the multi-LoRA tests of the engine and the router."""

from __future__ import annotations

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, folder, seed: int, r: int, targets: list[str], alpha: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # PEFT's random init is small; make the adapters change the output for sure
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    peft.save_pretrained(folder)
    return str(folder)


def peft_greedy(model_dir, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
