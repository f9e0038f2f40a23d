"""LoRA adapters made by PEFT itself on the tiny test model (`tools.tinymodel`), as a trainer
saves them: `adapter_model.safetensors`, then `adapter_config.json`."""

from __future__ import annotations

from pathlib import Path


def make_adapter(
    base: Path, out: Path, *, seed: int, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj")
) -> Path:
    """An adapter of random (non-zero) weights for the model in `base`, saved into `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # weights large enough to change greedy answers
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.5)
    peft_model.save_pretrained(out)
    return out
