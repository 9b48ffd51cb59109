"""A tiny Hugging Face Llama written by ``transformers`` itself: the reference for HF in/out tests.

Random weights; GQA with 4 query heads and 1 KV head, so on 2 ranks there are fewer KV heads
than CP ranks and FSDP's row shards of wk split its head (the case where the RoPE permutation is
not shard-local); head_dim 32 while hidden_size / heads = 16 (where torchtitan's adapter needs our
fix); Llama3 RoPE scaling whose three frequency bands are all populated (original context 32,
sequences of 64); float32 safetensors via ``save_pretrained``; and the shipped tokenizer
(vocabulary 2048) beside them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 64


def tiny_hf_config(*, tie_word_embeddings: bool = False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )


def write_tiny_hf_llama(folder: Path, *, seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    """Save a random tiny Llama (and the shipped tokenizer) to ``folder``; returns it."""
    torch.manual_seed(seed)
    config = tiny_hf_config(tie_word_embeddings=tie_word_embeddings)
    return save_with_random_norms(LlamaForCausalLM(config).float(), folder)


def save_with_random_norms(model: torch.nn.Module, folder: Path) -> Path:
    """Save a transformers model to ``folder`` with its norm weights drawn from [0.5, 1.5]
    (transformers initialises them to 1, which would hide them from the test), and the shipped
    tokenizer beside it; returns ``folder``."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "assets/tokenizer" / name, folder / name)
    return folder


def load_reference(folder: Path) -> LlamaForCausalLM:
    """``transformers``' own model from a folder, float32, eval mode."""
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def safetensors_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every .safetensors file in ``folder`` (top level), by name."""
    weights = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():
                weights[key] = file.get_tensor(key)
    return weights


def random_tokens(rows: int, seq_len: int = SEQ_LEN, seed: int = 1) -> torch.Tensor:
    """Token ids in [2, 2048): no BOS (0) or EOS (1), so every row is one document."""
    return torch.randint(2, 2048, (rows, seq_len), generator=torch.Generator().manual_seed(seed))
