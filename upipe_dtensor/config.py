"""Job configuration: TOML files mapped onto typed dataclasses, plus ``--section.key value`` overrides.

Section and key names follow torchtitan's ``JobConfig`` where torchtitan has them, so a torchtitan
user reads our files without a glossary. A file may name a base file with a top-level
``extends = "base.toml"`` (relative to itself); the base is loaded first and the file's keys win.
Every problem (unknown key, wrong type, impossible combination) raises ``ConfigError`` naming the
file, the key and a fix, before any process group exists.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A job configuration that cannot run; the message names the source, the key and a fix."""


CpStyle = Literal["upipe", "ulysses", "ring", "fpdt"]
"""The context-parallel attention styles; ``CP_STYLES`` (and so the planner's ``--styles``) follows."""
CP_STYLES: tuple[str, ...] = typing.get_args(CpStyle)


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder for this job's logs, tensorboard events and checkpoints."""
    description: str = "default job"
    """Free text, printed at start-up."""
    stop_grace_seconds: float = 20.0
    """After SIGTERM or SIGUSR1, wait this long for the running step to end, then save a snapshot
    and exit; if the step is still running then, exit at once without one. Keep it below the
    scheduler's kill delay (torchrun, Slurm KillWait, Kubernetes: 30 s) minus a save's time."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family; only torchtitan's Llama3 is supported."""
    flavor: str = "debugmodel"
    """Size preset: debugmodel, 8B or 32B (see upipe_dtensor.models), or 'hf': the shape in
    hf_assets_path/config.json (a named flavor must agree with that file when both are given)."""
    tokenizer_path: str = "assets/tokenizer"
    """Folder holding a Hugging Face tokenizer.json (or the file itself); empty means the one in
    hf_assets_path."""
    hf_assets_path: str = ""
    """A Hugging Face model folder (config.json, *.safetensors, tokenizer.json): the shape for
    flavor 'hf', and the weights that [checkpoint] initial_load_in_hf reads by default."""
    rope_theta: float = 0.0
    """RoPE base; 0 keeps the flavor's (or config.json's). Context extension often raises it."""
    rope_scaling_factor: float = 0.0
    """Llama3 RoPE scaling: long wavelengths are slowed down by this factor (1 = no scaling);
    0 keeps the flavor's (or config.json's)."""
    rope_low_freq_factor: float = 0.0
    """Llama3 RoPE scaling: wavelengths above original_max_position_embeddings / this are scaled
    fully; 0 keeps the flavor's."""
    rope_high_freq_factor: float = 0.0
    """Llama3 RoPE scaling: wavelengths below original_max_position_embeddings / this are kept;
    0 keeps the flavor's."""
    rope_original_max_position_embeddings: int = 0
    """Llama3 RoPE scaling: the context the unscaled model was trained at; 0 keeps the flavor's."""

    @property
    def tokenizer_folder(self) -> str:
        """Where the tokenizer is read from: tokenizer_path, else hf_assets_path."""
        return self.tokenizer_path or self.hf_assets_path


@dataclass
class Training:
    dataset: str = "local"
    """'local' reads dataset_path; any other value is a Hugging Face dataset name (streamed)."""
    dataset_path: str = "assets/corpus"
    """With dataset='local': a .txt/.jsonl/.parquet file or a folder of them."""
    dataset_text_field: str = "text"
    """Field (jsonl) or column (parquet, HF) holding each document's text."""
    local_batch_size: int = 1
    """Sequences per data-parallel rank per micro-batch."""
    seq_len: int = 2048
    """Tokens per sequence (the whole context; each CP rank holds seq_len / cp of it)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    steps: int = 100
    """Optimizer steps to train for."""
    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm (0 disables clipping)."""
    seed: int = 0
    """Seed for weight initialisation."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """FSDP2 parameter dtype for compute (CUDA only; CPU always computes in float32)."""
    mixed_precision_reduce: Literal["float32"] = "float32"
    """FSDP2 gradient reduction dtype."""
    enable_cpu_offload: bool = False
    """FSDP2 CPU offload: sharded parameters, gradients and optimizer state live in host memory
    and the optimizer steps there (frees ~12 GiB/GPU for 8B on 8 GPUs; costs host bandwidth)."""
    attention_mask: Literal["causal", "document"] = "causal"
    """'document': a token attends only to earlier tokens of its own document in a packed
    sequence (documents end at each EOS; torchtitan's block_causal). 'causal': across documents."""
    position_ids: Literal["global", "document"] = "global"
    """RoPE positions: 'global' counts from the sequence start, 'document' restarts at 0 at
    every document start (after each EOS)."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP data-parallel degree; -1 uses every rank not taken by context parallelism."""
    context_parallel_degree: int = 1
    """C: ranks that split each sequence (innermost mesh dimension)."""
    cp_style: CpStyle = "upipe"
    """Context-parallel attention: UPipe (a few heads per stage), classic Ulysses (all heads),
    ring attention (K/V passed around the CP group) or FPDT (Ulysses over sequence chunks, earlier
    chunks' K/V in host memory)."""
    heads_per_stage: int = 0
    """UPipe's U, query heads per stage across the head axis; 0 means U = C / ring_degree."""
    ring_degree: int = 1
    """R > 1: 2D context parallelism for upipe/ulysses, a ring of R ranks (across nodes) times a
    head axis of C / R ranks (inside a node); R divides context_parallel_degree."""
    fpdt_chunk_tokens: int = 0
    """Tokens per sequence chunk after the all-to-all, earlier chunks' K/V waiting in host memory.
    fpdt: 0 means 65536, the FPDT paper's setting. upipe: 0 runs each head stage over the whole
    sequence; a value > 0 is UPipe x FPDT, heads and sequence both chunked (the longest contexts)."""
    fsdp_reshard_after_forward: bool = True
    """Free gathered parameters after each block's forward (re-gathered in backward)."""

    @property
    def chunk_tokens(self) -> int:
        """The sequence chunk the style runs (0: none): fpdt_chunk_tokens as fpdt or upipe use it."""
        if self.cp_style == "fpdt":
            return self.fpdt_chunk_tokens or FPDT_PAPER_CHUNK_TOKENS
        return self.fpdt_chunk_tokens if self.cp_style == "upipe" else 0


FPDT_PAPER_CHUNK_TOKENS = 65536
"""The FPDT paper's chunk for Llama3-8B on 8 GPUs (``--ds-sequence-parallel-fpdt-chunk-size``)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full"] = "none"
    """'full' recomputes each TransformerBlock in backward, keeping only its input."""
    cpu_offload: bool = False
    """Keep the checkpointed block inputs in host memory (async pinned copies, prefetched)."""
    cpu_offload_skip_last: int = 1
    """The last N blocks keep their inputs on the device: backward needs them first."""
    blocks_per_checkpoint: int = 1
    """Blocks checkpointed together, keeping one saved input per group: k > 1 divides the host
    (or device) memory of saved block inputs by k, for one more forward of k - 1 blocks per group
    in backward and k - 1 more block inputs on the device while a group recomputes."""
    cpu_offload_prefetch: bool = True
    """Copy the next block's input back while the current block recomputes. At millions of
    tokens a block takes minutes and the copy a fraction of a second, so the long recipes turn it
    off: the prefetched input would sit on the device through the whole block (one more (S/C, D)
    tensor at the peak)."""


@dataclass
class Memory:
    tiled_mlp: bool = False
    """Run each SwiGLU MLP over tiles of tokens, recomputing a tile's hidden state in backward."""
    mlp_tile_tokens: int = 0
    """Tokens per MLP tile; 0 means the model width (ceil(tokens / dim) tiles)."""
    tiled_rms_norm: bool = False
    """Run every RMSNorm over tiles of tokens: no full-size float32 intermediates are kept."""
    norm_tile_tokens: int = 0
    """Tokens per RMSNorm tile; 0 means the model width."""
    chunked_loss: bool = False
    """Fuse the output projection and cross-entropy over token chunks: no full logits."""
    loss_chunk_tokens: int = 4096
    """Tokens per loss chunk (one chunk of float32 logits, chunk x vocab, is alive at a time)."""
    expandable_segments: bool = True
    """CUDA: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, so the per-stage and per-tile
    buffers of different sizes do not fragment the caching allocator (unless already set)."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer; AdamW (fused kernel on CUDA)."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from lr/warmup_steps to lr."""
    decay_type: Literal["linear", "cosine"] = "cosine"
    """Shape of the decay after warmup."""
    min_lr_factor: float = 0.0
    """The decay ends at lr * min_lr_factor."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save torch.distributed.checkpoint snapshots and resume from the latest one."""
    folder: str = "checkpoint"
    """Sub-folder of job.dump_folder that holds step-N snapshots."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 2
    """Delete older snapshots, keeping this many (0 keeps all)."""
    load_step: int = -1
    """Resume from this step's snapshot; -1 picks the latest complete one."""
    initial_load_path: str = ""
    """Weights to start from when there is no snapshot to resume from yet (snapshots win): a
    DCP checkpoint (model-only, or one of our snapshots), or with initial_load_in_hf a Hugging
    Face folder; empty with initial_load_in_hf means [model] hf_assets_path."""
    initial_load_in_hf: bool = False
    """initial_load_path (or hf_assets_path) is a Hugging Face safetensors folder."""
    last_save_in_hf: bool = False
    """After the last step, also write the model as a Hugging Face folder (config.json,
    safetensors, tokenizer) to {folder}/step-N-hf, loadable by transformers and vLLM."""
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """Weight dtype of the Hugging Face export (float32 keeps the trained weights exactly)."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Print a metrics line every this many steps."""
    enable_tensorboard: bool = True
    """Write the same scalars as tensorboard events."""
    save_tb_folder: str = "tb"
    """Sub-folder of job.dump_folder for tensorboard events."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each TransformerBlock (fullgraph)."""
    backend: str = "inductor"


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    memory: Memory = field(default_factory=Memory)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    compile: Compile = field(default_factory=Compile)
    config_file: str | None = None
    """The job file this config was loaded from (set by the loader)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each non-default key was set: ``"section.key"`` -> a file path or ``"command line"``."""

    def source_of(self, *keys: str) -> str:
        """The file(s) or the command line that set these ``"section.key"`` values, so an error
        blames where the user wrote the value (defaults are blamed on the job file)."""
        found = dict.fromkeys(self.sources[key] for key in keys if key in self.sources)
        return " and ".join(found) or self.config_file or "defaults"


# --- loading --------------------------------------------------------------------------------------


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {
        f.name: hints[f.name] for f in dataclasses.fields(JobConfig)
        if dataclasses.is_dataclass(hints[f.name])
    }


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _shown(path: Path) -> str:
    """A path as the user would write it: relative to the working directory when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _from_text(value: str, annotation: Any) -> Any:
    """A command-line string converted to the field's type, or the string if it does not convert."""
    if annotation is bool and value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        if annotation is kind:
            try:
                return kind(value.replace("_", "")) if kind is int else kind(value)
            except ValueError:
                return value
    optional = typing.get_args(annotation)
    if optional and type(None) in optional and typing.get_origin(annotation) is not Literal:
        inner = next(a for a in optional if a is not type(None))
        return None if value in ("none", "None") else _from_text(value, inner)
    return value


def _coerce(value: Any, annotation: Any, where: str, *, from_text: bool = False) -> Any:
    """Check ``value`` against a field's annotation. Only command-line strings (``from_text``) are
    converted: in a TOML file ``seq_len = "256"`` is a string, and TOML has typed values for that."""
    if from_text:
        value = _from_text(value, annotation)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where} = {value!r} is not one of {list(choices)}")
        return value
    optional = typing.get_args(annotation)
    if optional and type(None) in optional:  # X | None
        if value is None:
            return None
        annotation = next(a for a in optional if a is not type(None))
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is str and isinstance(value, str):
        return value
    type_name = getattr(annotation, "__name__", str(annotation))
    fix = "; write it without quotes" if isinstance(value, str) and not from_text else ""
    raise ConfigError(f"{where} = {value!r} should be of type {type_name}{fix}")


def _read_toml(
    path: Path, seen: tuple[Path, ...] = (), extended_by: str = ""
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The file's sections merged over its ``extends`` chain (base first), and the file that set
    each ``"section.key"``. ``extended_by`` names the file whose ``extends`` pointed here."""
    shown = _shown(path)
    if not path.is_file():
        if path.is_dir():
            tomls = sorted(_shown(p) for p in path.glob("*.toml"))[:5]
            example = f", e.g. {', '.join(tomls)}" if tomls else ""
            raise ConfigError(f"{extended_by}config file {shown} is a folder; pass a .toml job file{example}")
        fix = "fix the path (relative to that file)" if extended_by else "pass --config PATH to a .toml job file"
        raise ConfigError(f"{extended_by}config file {shown} does not exist; {fix}")
    if path in seen:
        raise ConfigError(f"{shown}: 'extends' cycle through {' -> '.join(map(_shown, seen))}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{shown}: invalid TOML: {err}") from err
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    base = raw.pop("extends", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{shown}: extends = {base!r} should be a path string")
        merged, sources = _read_toml(
            (path.parent / base).resolve(), seen + (path,), f"{shown}: extends = {base!r}, but the "
        )
    sections = _sections()
    for name, table in raw.items():
        if name not in sections:
            raise ConfigError(
                f"{shown}: unknown section [{name}]; known sections: {sorted(sections)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{shown}: '{name}' must be a [{name}] table, not a value")
        known = _field_types(sections[name])
        for key, value in table.items():
            if key not in known:
                raise ConfigError(
                    f"{shown}: unknown key [{name}] {key}; known keys of [{name}]: {sorted(known)}"
                )
            merged.setdefault(name, {})[key] = _coerce(value, known[key], f"{shown}: [{name}] {key}")
            sources[f"{name}.{key}"] = shown
    return merged, sources


def _parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """``--section.key value`` (or ``--section.key=value``) pairs, typed against the dataclasses."""
    overrides: dict[str, dict[str, Any]] = {}
    sections = _sections()
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"command line: expected --section.key value, got {arg!r}; "
                "sections and keys are listed by --help"
            )
        name_key, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {arg} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        section, _, key = name_key.partition(".")
        if section not in sections:
            raise ConfigError(f"command line: unknown section in --{name_key}; known: {sorted(sections)}")
        known = _field_types(sections[section])
        if key not in known:
            raise ConfigError(
                f"command line: unknown key --{name_key}; known keys of [{section}]: {sorted(known)}"
            )
        overrides.setdefault(section, {})[key] = _coerce(
            value, known[key], f"command line: --{name_key}", from_text=True
        )
    return overrides


def load_config(config_file: str | None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults <- the TOML file (and its bases) <- command-line overrides; validated types."""
    values: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    if config_file is not None:
        values, sources = _read_toml(Path(config_file).resolve())
    for section, table in _parse_overrides(overrides or []).items():
        values.setdefault(section, {}).update(table)
        sources.update({f"{section}.{key}": "command line" for key in table})
    sections = _sections()
    return JobConfig(
        **{name: sections[name](**values.get(name, {})) for name in sections},
        config_file=config_file,
        sources=sources,
    )


def parse_args(argv: list[str]) -> JobConfig:
    """``--config FILE.toml`` (optional: defaults otherwise) and any ``--section.key value``
    overrides."""
    config_file = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("command line: --config needs a path to a .toml job file")
            config_file, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            config_file, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return load_config(config_file, rest)


def _field_docs(section_cls: type) -> dict[str, str]:
    """The docstring under each field of a section (Python keeps none at run time: read the source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(section_cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def config_help() -> str:
    """Every ``--section.key`` with its type, default and docstring, for ``train.py --help``."""
    lines = []
    for name, section_cls in _sections().items():
        lines.append(f"[{name}]")
        docs = _field_docs(section_cls)
        for f in dataclasses.fields(section_cls):
            annotation = _field_types(section_cls)[f.name]
            kind = (" | ".join(map(repr, typing.get_args(annotation)))
                    if typing.get_origin(annotation) is Literal
                    else getattr(annotation, "__name__", str(annotation)))
            lines.append(f"  --{name}.{f.name} ({kind}, default {f.default!r})")
            if f.name in docs:
                lines.append(textwrap.fill(docs[f.name], 100, initial_indent=" " * 6,
                                           subsequent_indent=" " * 6))
    return "\n".join(lines)


def _check_positive(config: JobConfig, fail) -> None:
    for section, key, minimum in (
        ("training", "steps", 1),
        ("training", "seq_len", 1),
        ("training", "local_batch_size", 1),
        ("training", "gradient_accumulation_steps", 1),
        ("parallelism", "context_parallel_degree", 1),
        ("parallelism", "ring_degree", 1),
        ("parallelism", "fpdt_chunk_tokens", 0),
        ("lr_scheduler", "warmup_steps", 0),
        ("checkpoint", "interval", 1),
        ("checkpoint", "keep_latest_k", 0),
        ("metrics", "log_freq", 1),
        ("activation_checkpoint", "cpu_offload_skip_last", 0),
        ("activation_checkpoint", "blocks_per_checkpoint", 1),
        ("memory", "mlp_tile_tokens", 0),
        ("memory", "norm_tile_tokens", 0),
        ("memory", "loss_chunk_tokens", 1),
        ("model", "rope_theta", 0),
        ("model", "rope_scaling_factor", 0),
        ("model", "rope_low_freq_factor", 0),
        ("model", "rope_high_freq_factor", 0),
        ("model", "rope_original_max_position_embeddings", 0),
    ):
        value = getattr(getattr(config, section), key)
        if value < minimum:
            fail(f"[{section}] {key} = {value} must be >= {minimum}", f"{section}.{key}")
    if config.optimizer.lr <= 0:
        fail(f"[optimizer] lr = {config.optimizer.lr} must be > 0", "optimizer.lr")
    if config.training.max_norm < 0:
        fail(f"[training] max_norm = {config.training.max_norm} must be >= 0 (0 disables clipping)",
             "training.max_norm")
    if not 0 <= config.lr_scheduler.min_lr_factor <= 1:
        fail(f"[lr_scheduler] min_lr_factor = {config.lr_scheduler.min_lr_factor} must be in [0, 1]",
             "lr_scheduler.min_lr_factor")
    if config.job.stop_grace_seconds <= 0:
        fail(f"[job] stop_grace_seconds = {config.job.stop_grace_seconds} must be > 0",
             "job.stop_grace_seconds")
    if config.checkpoint.load_step < -1 or config.checkpoint.load_step == 0:
        fail(f"[checkpoint] load_step = {config.checkpoint.load_step} must be -1 (the latest "
             "snapshot) or a snapshot's step", "checkpoint.load_step")


def _check_context_parallel(config: JobConfig, args, fail) -> None:
    """The CP style's geometry: ring and head axes, heads per stage, FPDT chunks."""
    from .parallel.head_schedule import make_head_schedule
    from .parallel.layouts import chunk_count

    parallelism = config.parallelism
    cp, ring, style = parallelism.context_parallel_degree, parallelism.ring_degree, parallelism.cp_style
    if ring < 1 or cp % ring:
        divisors = [r for r in range(1, cp + 1) if cp % r == 0]
        fail(
            f"[parallelism] ring_degree = {ring} must divide context_parallel_degree = {cp}; "
            f"use one of {divisors}", "parallelism.ring_degree", "parallelism.context_parallel_degree"
        )
    if ring > 1 and style not in ("upipe", "ulysses"):
        fail(
            f"[parallelism] ring_degree = {ring} adds a ring axis to cp_style 'upipe' or 'ulysses'; "
            f"cp_style {style!r} " + ("is already a ring over all C ranks" if style == "ring"
                                      else "has no ring axis") + ": set ring_degree = 1",
            "parallelism.ring_degree", "parallelism.cp_style",
        )
    if parallelism.heads_per_stage and style in ("ulysses", "ring", "fpdt"):
        hint = (" (FPDT runs all heads per chunk, as published; for UPipe x FPDT use cp_style = "
                "'upipe' with fpdt_chunk_tokens > 0)" if style == "fpdt" else "")
        fail(f"[parallelism] heads_per_stage does not apply to cp_style {style!r}; remove it{hint}",
             "parallelism.heads_per_stage", "parallelism.cp_style")
    if parallelism.fpdt_chunk_tokens and style in ("ulysses", "ring"):
        fail(f"[parallelism] fpdt_chunk_tokens applies to cp_style 'fpdt' and 'upipe' (UPipe x "
             f"FPDT), not {style!r}; remove it", "parallelism.fpdt_chunk_tokens", "parallelism.cp_style")
    if style == "ring":  # any number of heads: nothing is exchanged by head
        return
    if parallelism.chunk_tokens:
        if ring > 1:
            fail("[parallelism] fpdt_chunk_tokens (sequence chunks) and ring_degree > 1 cannot be "
                 "combined: chunk the sequence on one node, or use a ring across nodes",
                 "parallelism.fpdt_chunk_tokens", "parallelism.ring_degree")
        try:
            chunk_count(config.training.seq_len, cp, parallelism.chunk_tokens)
        except ValueError as err:
            fail(f"[parallelism] fpdt_chunk_tokens = {parallelism.chunk_tokens}: {err}",
                 "parallelism.fpdt_chunk_tokens", "training.seq_len", "parallelism.context_parallel_degree")
    heads = cp // ring
    if style in ("ulysses", "fpdt"):
        heads_per_stage = args.n_heads
    else:
        heads_per_stage = parallelism.heads_per_stage or heads
    try:
        make_head_schedule(args.n_heads, args.n_kv_heads or args.n_heads, heads, heads_per_stage)
    except ValueError as err:
        axis = f"head axis of {heads} ranks (C / ring_degree)" if ring > 1 else f"cp degree {cp}"
        fail(f"[parallelism] cp_style {style!r} over a {axis}, flavor {config.model.flavor!r}: {err}",
             "model.flavor", "parallelism.cp_style", "parallelism.heads_per_stage",
             "parallelism.context_parallel_degree", "parallelism.ring_degree")


def check_job(config: JobConfig, world_size: int) -> int:
    """Reject impossible combinations before any heavy work; returns the dp_shard degree."""
    from .models.hf_config import model_args
    from .weights import check_initial_load

    def fail(reason: str, *keys: str) -> None:
        """``keys``: the ``"section.key"`` values at fault; the message names where they were set."""
        raise ConfigError(f"{config.source_of(*keys)}: {reason}")

    _check_positive(config, fail)
    parallelism, training = config.parallelism, config.training
    cp = parallelism.context_parallel_degree
    cp_key, dp_key = "parallelism.context_parallel_degree", "parallelism.data_parallel_shard_degree"
    if world_size % cp:
        fail(
            f"[parallelism] context_parallel_degree = {cp} does not divide the {world_size} "
            f"launched processes; launch a multiple of {cp} or change the degree", cp_key
        )
    dp = parallelism.data_parallel_shard_degree
    if dp == -1:
        dp = world_size // cp
    if dp * cp != world_size:
        fail(
            f"[parallelism] data_parallel_shard_degree {dp} x context_parallel_degree {cp} = "
            f"{dp * cp} != {world_size} launched processes; set data_parallel_shard_degree = "
            f"{world_size // cp} (or -1)", dp_key, cp_key
        )
    if training.seq_len % cp:
        fail(
            f"[training] seq_len = {training.seq_len} is not divisible by context_parallel_degree "
            f"= {cp}; use a multiple of {cp}, e.g. {training.seq_len // cp * cp or cp}",
            "training.seq_len", cp_key,
        )
    if config.model.name != "llama3":
        fail(f"[model] name = {config.model.name!r}: only 'llama3' is supported", "model.name")
    model_keys = ("model.flavor", "model.hf_assets_path", "training.seq_len")
    try:
        args = model_args(config.model, training.seq_len)
    except ValueError as err:
        fail(str(err), *model_keys)
    try:
        check_initial_load(config, args)
    except ValueError as err:
        fail(str(err), "checkpoint.initial_load_path", "checkpoint.initial_load_in_hf", *model_keys)
    if config.activation_checkpoint.cpu_offload and config.activation_checkpoint.mode != "full":
        fail(
            "[activation_checkpoint] cpu_offload moves the inputs that full checkpointing keeps; "
            "set mode = 'full' as well",
            "activation_checkpoint.cpu_offload", "activation_checkpoint.mode",
        )
    if config.activation_checkpoint.blocks_per_checkpoint > 1 and config.activation_checkpoint.mode != "full":
        fail(
            "[activation_checkpoint] blocks_per_checkpoint groups blocks for full checkpointing; "
            "set mode = 'full' as well",
            "activation_checkpoint.blocks_per_checkpoint", "activation_checkpoint.mode",
        )
    _check_context_parallel(config, args, fail)
    dataset = training.dataset
    if not dataset.strip() or dataset != dataset.strip():
        fail(
            f"[training] dataset = {dataset!r}: use 'local' (files at dataset_path) or a Hugging "
            "Face dataset name without surrounding spaces", "training.dataset"
        )
    if dataset == "local" and not os.path.exists(training.dataset_path):
        fail(
            f"[training] dataset_path = {training.dataset_path!r} does not exist; point it at a "
            f".txt/.jsonl/.parquet file or folder, or set dataset to a Hugging Face dataset name",
            "training.dataset_path",
        )
    if not os.path.exists(config.model.tokenizer_folder):
        fail(
            f"[model] tokenizer_path = {config.model.tokenizer_path!r} (hf_assets_path = "
            f"{config.model.hf_assets_path!r}) does not exist; point it at a folder with a "
            f"Hugging Face tokenizer.json", "model.tokenizer_path", "model.hf_assets_path"
        )
    if not config.job.dump_folder.strip():
        fail("[job] dump_folder is empty; name a folder for logs and checkpoints", "job.dump_folder")
    return dp
