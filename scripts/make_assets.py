"""Regenerate ``assets/``: an offline English prose corpus and a byte-level BPE tokenizer for it.

The corpus is the docstrings of the CPython standard library that runs this script (PSF License),
read with ``ast`` from the source files, so nothing is imported or downloaded. One document per
module: its docstring followed by the docstrings of its classes and functions, in source order.
Re-running with the same Python and ``tokenizers`` versions reproduces every file byte for byte.

    python scripts/make_assets.py [--out assets]
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB_SIZE = 2048
# Packages that are tests, GUI demos or generated tables rather than documented library code.
SKIP_TOP_LEVEL = {
    "test",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "site-packages",
    "encodings",
    "pydoc_data",
}
MIN_DOC_CHARS = 1500  # modules with less prose than this are mostly one-liners
CORPUS_BUDGET = 1_000_000  # characters; keeps the shipped assets small
N_TXT_FILES = 3


def module_documents(stdlib: Path) -> list[tuple[str, str]]:
    """(module name, document) for every stdlib module with enough docstring prose, by name."""
    seen: set[str] = set()  # one copy of docstrings that repeat ("Return self==value.")
    documents = []
    for path in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        parts = path.relative_to(stdlib).with_suffix("").parts
        if parts[0] in SKIP_TOP_LEVEL or "tests" in parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):  # a few stdlib files are deliberately invalid
            continue
        name = ".".join(p for p in parts if p != "__init__")
        sections = []
        for title, doc in _docstrings(tree, name):
            if doc not in seen:
                seen.add(doc)
                sections.append(f"{title}\n\n{doc}")
        text = "\n\n".join(sections).replace("\f", "\n")  # form feeds separate .txt documents
        if len(text) >= MIN_DOC_CHARS:
            documents.append((name, text))
    return documents


def _docstrings(node: ast.AST, qualname: str):
    """Yield (qualified name, docstring) for ``node`` and its nested classes/functions, in order."""
    doc = ast.get_docstring(node)
    if doc:
        yield qualname, doc.strip()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _docstrings(child, f"{qualname}.{child.name}")


def within_budget(documents: list[tuple[str, str]], budget: int) -> list[tuple[str, str]]:
    """Keep every k-th document so the total fits ``budget``: a spread of the library, not A-D."""
    total = sum(len(text) for _, text in documents)
    stride = -(-total // budget)
    return documents[::stride] if stride > 1 else documents


def write_corpus(documents: list[tuple[str, str]], out: Path) -> None:
    """Deal documents round-robin into N_TXT_FILES .txt files, one .jsonl and one .parquet."""
    out.mkdir(parents=True, exist_ok=True)
    n_files = N_TXT_FILES + 2
    shards = [documents[i::n_files] for i in range(n_files)]
    for i, shard in enumerate(shards[:N_TXT_FILES]):
        text = "\n\f\n".join(text for _, text in shard) + "\n"
        (out / f"stdlib_docs_{i}.txt").write_text(text, encoding="utf-8")
    with open(out / "stdlib_docs.jsonl", "w", encoding="utf-8") as f:
        for name, text in shards[N_TXT_FILES]:
            f.write(json.dumps({"module": name, "text": text}, ensure_ascii=False) + "\n")
    names, texts = zip(*shards[N_TXT_FILES + 1])
    table = pa.table({"module": list(names), "text": list(texts)})
    pq.write_table(table, out / "stdlib_docs.parquet", compression="zstd")


def train_tokenizer(texts: list[str], out: Path) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) with BOS/EOS as ids 0 and 1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    config_text = json.dumps(config, indent=2) + "\n"
    (out / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    return tokenizer


def write_readme(out: Path, documents: list[tuple[str, str]], n_tokens: int) -> None:
    """Provenance and license of the generated files (not under corpus/, so never read as data)."""
    chars = sum(len(text) for _, text in documents)
    (out / "README.md").write_text(
        "# Shipped assets (generated by `scripts/make_assets.py`; do not edit by hand)\n\n"
        f"- `corpus/`: {len(documents)} documents, {chars:,} characters, {n_tokens:,} tokens with "
        "the tokenizer below (BOS/EOS excluded). One document per CPython standard-library module: "
        "its docstrings, extracted with `ast`. Text (c) Python Software Foundation, PSF License "
        f"Agreement v2. Source: CPython {platform.python_version()}.\n"
        "  `.txt` files hold several documents separated by form feeds (`\\f`); `.jsonl` and "
        "`.parquet` hold one per record in field `text`. No document appears twice.\n"
        "- `tokenizer/`: byte-level BPE trained on the corpus with `tokenizers` "
        f"{tokenizers.__version__}, {VOCAB_SIZE} tokens, BOS `{BOS}` = 0, EOS `{EOS}` = 1.\n",
        encoding="utf-8",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets")
    args = parser.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = within_budget(module_documents(stdlib), CORPUS_BUDGET)
    write_corpus(documents, args.out / "corpus")
    texts = [text for _, text in documents]
    tokenizer = train_tokenizer(texts, args.out / "tokenizer")
    n_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    write_readme(args.out, documents, n_tokens)
    chars = sum(map(len, texts))
    print(f"{len(documents)} documents, {chars:,} chars, {n_tokens:,} tokens -> {args.out}")


if __name__ == "__main__":
    main()
