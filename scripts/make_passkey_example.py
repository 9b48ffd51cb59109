"""Write the inputs of the passkey example in docs/context-extension.md: a synthetic passkey
corpus, the haystack to evaluate on, and the shape of a tiny model to train on them.

- ``train/passkey.jsonl``: each document is one prompt of ``evaluate --task passkey`` with its
  answer, as text: the task's instruction, LongLoRA's filler sentences with the pass key line
  between two of them at a random depth, the question and the answer.
- ``haystack.txt``: the filler alone, for ``evaluate --task passkey --haystack``.
- ``model/config.json``: a 2-layer Llama (width 128, 4 query and 2 KV heads, the shipped
  tokenizer's 2048 tokens) for ``[model] flavor = "hf"``; it trains from the seed's weights.

    python scripts/make_passkey_example.py outputs/passkey_data --digits 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

from upipe_dtensor.commands.retrieval import TASKS, Template

FILLER = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
]
"""LongLoRA's passkey haystack, five sentences repeated."""

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def document(task: Template, rng: random.Random, sentences: int) -> str:
    """A passkey prompt and its answer with ``sentences`` filler sentences around the needle."""
    fill = {"value": rng.randrange(10 ** (task.digits - 1), 10**task.digits)}
    start = rng.randrange(len(FILLER))
    filler = [" " + FILLER[(start + i) % len(FILLER)] for i in range(sentences)]
    depth = rng.randint(0, sentences)
    return "".join(
        [
            task.instruction,
            *filler[:depth],
            task.needle.format(**fill),
            *filler[depth:],
            task.question,
            task.answer.format(**fill),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for train/, haystack.txt and model/")
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--digits", type=int, default=TASKS["passkey"].digits)
    parser.add_argument("--min-sentences", type=int, default=3, help="filler per document")
    parser.add_argument("--max-sentences", type=int, default=22)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    task = dataclasses.replace(TASKS["passkey"], digits=args.digits)
    rng = random.Random(args.seed)
    for folder in ("train", "model"):
        (args.out / folder).mkdir(parents=True, exist_ok=True)
    with (args.out / "train" / "passkey.jsonl").open("w") as file:
        for _ in range(args.documents):
            text = document(task, rng, rng.randint(args.min_sentences, args.max_sentences))
            file.write(json.dumps({"text": text}) + "\n")
    (args.out / "haystack.txt").write_text(" ".join(FILLER * 2000) + "\n")
    (args.out / "model" / "config.json").write_text(json.dumps(TINY_LLAMA, indent=1) + "\n")
    print(f"wrote {args.documents} documents, haystack.txt and model/config.json to {args.out}")


if __name__ == "__main__":
    main()
