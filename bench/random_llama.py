"""Llama-shaped models (and an OLMoE-shaped MoE one) with random weights, for speed measurements where the weights'
values do not matter (a GPU run of the serving engine or of decode on a 1B or 8B shape, the FP8 MoE experts on a CPU,
with no model hub to fetch one from).

    python bench/random_llama.py SIZE OUT --tokenizer DIR [--device cuda]

writes a bf16 Hugging Face model folder (config, safetensors, the tokenizer of DIR; vocabulary sized to it) that
`hqtflow measure`, `quantize` and `serve` take like any other model.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8),  # Llama-3.2-1B's decoder
          "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),  # a smoke run of the scripts' code on a CPU
          "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8),  # Llama-3-8B's decoder
          "moe-2l": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                         num_experts_per_tok=8)}  # two of OLMoE-1B-7B's MoE decoder layers


def llama(size: str, vocab: int, device: str = "cpu"):
    """A bf16 causal LM of SHAPES[size] (Llama unless it names another model_type) with random weights, built on
    `device` (no float32 copy first)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[size])
    cfg = AutoConfig.for_model(shape.pop("model_type", "llama"), vocab_size=vocab, max_position_embeddings=4096,
                               tie_word_embeddings=False, **shape)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg).eval()
    finally:
        torch.set_default_dtype(dtype)
    model.generation_config.eos_token_id = None
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("size", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("--tokenizer", required=True, help="a folder with a Hugging Face tokenizer")
    p.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: faster for 8b)")
    a = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    torch.manual_seed(0)
    model = llama(a.size, len(tok), a.device)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"{a.out}: {model.config.model_type} {a.size}, {sum(t.numel() for t in model.parameters()) / 1e9:.2f} B parameters, "
          f"random bf16 weights, vocabulary {len(tok)}")


if __name__ == "__main__":
    main()
