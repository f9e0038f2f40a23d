"""Tiny random Llama checkpoints, generated locally: no model is ever downloaded.

head_dim is 48: vLLM's CPU attention rejects 16, and takes its AMX bfloat16 kernel (which
crashes the worker on the CPUs here) for multiples of 32; at 48 it takes the vector kernel,
so the engine serves bfloat16 as users' engines do. Weights are saved in bfloat16, so a
reloaded checkpoint and a freshly started engine hold bit-identical parameters.
"""

from __future__ import annotations

from pathlib import Path

WORDS = [f"w{i}" for i in range(250)]
SPECIAL = ["<unk>", "<s>", "</s>"]
VOCAB_SIZE = 256


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))


def write_checkpoint(
    out: Path, *, seed: int, hidden_size: int = 96, layers: int = 2, head_dim: int = 48
) -> Path:
    """Write a random Llama with its tokenizer into `out` (HF layout, safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=hidden_size // head_dim,
        head_dim=head_dim,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    # transformers types `.to` through a decorator that mypy reads as taking the model.
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    # Large weights make greedy outputs differ clearly between seeds.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    write_tokenizer(out)
    return out
