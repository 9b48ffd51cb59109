"""The job configuration's schema: one dataclass per TOML section, a docstring under each field.

Section and key names follow torchtitan's ``JobConfig`` where torchtitan has them, so a torchtitan
user reads our files without a glossary. ``--help`` prints the field docstrings. A CP style's own
keys of ``[parallelism]`` (U, sequence chunks, ...) are not written here: each registered style
declares them in its options dataclass (``parallel.style_options``), which ``[parallelism]``
reads through the registry (``parallel.registry``), so a style's options, their defaults and
their checks live in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from upipe_dtensor.errors import ConfigError as ConfigError  # its documented home re-exports it
from upipe_dtensor.parallel import registry
from upipe_dtensor.parallel.style_options import OptionError, StyleOptions


class CpStyle(str):
    """A context-parallel style's name: one registered in ``parallel.registry`` (the loader
    checks a value against ``choices``, as it checks a Literal's)."""

    @staticmethod
    def choices() -> tuple[str, ...]:
        return registry.style_names()


class StyleOptionValues(dict[str, Any]):
    """The ``[parallelism]`` keys that the registered styles' options declare, as a job sets
    them (key -> value; unset keys take cp_style's defaults). The loader reads these keys as keys
    of ``[parallelism]`` itself, typed by their declarations, and ``--help`` lists them under each
    style (``declarations``)."""

    @staticmethod
    def declarations() -> dict[str, type]:
        """Each registered style's options dataclass, under the heading ``--help`` shows."""
        return {f"options of cp_style {n!r}": s.options for n, s in registry.STYLES.items()}

    @staticmethod
    def types() -> dict[str, Any]:
        """Every declared key -> its type."""
        return registry.option_types()


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder for this job's logs, tensorboard events and checkpoints."""
    description: str = "default job"
    """Free text, printed at start-up."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the job runs: 'auto' is each process's GPU under torchrun when CUDA works, else the
    CPU; 'cuda' refuses to start without a usable GPU (a broken CUDA install never trains on the
    CPU unnoticed); 'cpu' runs on the CPU with gloo even where GPUs exist."""
    stop_grace_seconds: float = 20.0
    """After SIGTERM, SIGUSR1 or Ctrl-C, wait this long for the running step to end, then save a
    snapshot and exit; if the step is still running then, exit at once without one. Keep it below
    the scheduler's kill delay (torchrun, Slurm KillWait, Kubernetes: 30 s) minus a save's time."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family (upipe_dtensor.models.family): 'llama3' or 'qwen3'."""
    flavor: str = "debugmodel"
    """Size preset of the family (llama3: debugmodel, 8B, 32B; qwen3: debugmodel, 0.6B, 1.7B, 4B,
    8B, 14B, 32B), or 'hf': the shape in hf_assets_path/config.json (a named flavor must agree
    with that file when both are given)."""
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
    moe_force_load_balance: bool = False
    """A mixture of experts routes token choice i to expert i mod E, whatever the router scores
    (torchtitan's [debug] moe_force_load_balance): every expert gets as many tokens, the routing
    the planner plans expert parallelism with. For measuring against a plan, not for training."""

    @property
    def tokenizer_folder(self) -> str:
        """Where the tokenizer is read from: tokenizer_path, else hf_assets_path."""
        return self.tokenizer_path or self.hf_assets_path


@dataclass
class DataSource:
    """One ``[[training.sources]]`` table: a part of the training data mixture. As in Fu et al.
    2024 (Data Engineering for Scaling Language Models to 128K Context), each source keeps its
    share of the tokens while its long documents are upsampled within it. A document's length is
    counted as it is packed: its tokens plus BOS and EOS."""

    path: str = ""
    """A .txt/.jsonl/.parquet file or a folder of them (dataset_text_field names the text), or a
    token folder (python -m upipe_dtensor.tokenize)."""
    weight: float = 1.0
    """This source's share of the mixture's tokens, relative to the others: weight / (sum of the
    weights), counted after upsampling, whatever the source's size."""
    upsample_min_tokens: int = 0
    """Documents of at least this many tokens are the long ones that upsample_factor repeats."""
    upsample_factor: int = 1
    """How many times each long document appears per pass over the source (1: no upsampling).
    Its extra copies are spread over the next documents of the source, placed by [training] seed."""


def source_label(number: int) -> str:
    """The ``number``-th (from 1) ``[[training.sources]]`` table, as every message names it."""
    return f"[[training.sources]] #{number}"


@dataclass
class Training:
    dataset: str = "local"
    """'local' reads dataset_path; any other value is a Hugging Face dataset name (streamed)."""
    dataset_config_name: str = ""
    """A Hugging Face dataset's subset (its config name, load_dataset's name), e.g. 'sample-10BT'
    of 'HuggingFaceFW/fineweb-edu'; empty: the dataset's default."""
    dataset_split: str = "train"
    """The split of a Hugging Face dataset to train on."""
    dataset_path: str = "assets/corpus"
    """With dataset='local': a .txt/.jsonl/.parquet file or a folder of them, or a token folder
    written by python -m upipe_dtensor.tokenize (memory-mapped, not tokenized; the one source
    when there are no [[training.sources]] tables)."""
    sources: list[DataSource] = field(default_factory=list)
    """Train on a mixture of local sources instead of dataset_path, each with its share of the
    tokens and its long documents upsampled; python -m upipe_dtensor.data_report shows it."""
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
    """Seed for weight initialisation and for where upsampled documents' copies are placed."""
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
    skip_bad_records: bool = False
    """Skip data records that cannot be documents (a line that is not JSON, no
    dataset_text_field, a text that is not a string or is blank) instead of refusing to start;
    the start-up log counts them and names the first few by file and line."""

    @property
    def data_sources(self) -> list[DataSource]:
        """The local sources trained on: the [[training.sources]] tables, else dataset_path as the
        one source (the defaults of ``DataSource``: weight 1, no upsampling)."""
        return self.sources or [DataSource(path=self.dataset_path)]


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
    ring_degree: int = 1
    """R > 1: 2D context parallelism for a style with a ring axis (upipe, ulysses), a ring of R
    ranks (across nodes) times a head axis of C / R ranks (inside a node); R divides
    context_parallel_degree."""
    tensor_parallel_degree: int = 1
    """T: tensor parallelism (torchtitan's layout): each block's heads and MLP columns split over
    T ranks (the innermost mesh dimension: one node's NVLink), the activations between blocks
    sequence-parallel (each of the T ranks holds 1/T of its CP shard's tokens); the CP style runs
    over cp on each rank's heads. T divides the query and the KV heads, and seq_len / C."""
    expert_parallel_degree: int = 1
    """E > 1: a mixture of experts' experts split over groups of E ranks borrowed from
    dp_shard x cp (consecutive ranks: inside one sequence's head axis first), each group's tokens
    sent to the ranks holding their experts and back (all-to-all), as torchtitan composes expert
    parallelism; FSDP2 shards each rank's experts over the ranks outside its group. E divides
    dp_shard x C and the number of experts."""
    attention_backend: Literal["auto", "fa3", "fa4", "cudnn", "flash", "sdpa"] = "auto"
    """Local attention kernel: 'fa3' FlashAttention-3 (Hopper) and 'fa4' FlashAttention-4 (Hopper,
    Blackwell) through torch's flash-attention registry, 'cudnn' aten's cuDNN attention (no
    document masks), 'flash' the flash-attn package (FlashAttention-2, >= 2.7), 'sdpa' PyTorch's
    own (aten's FlashAttention-2 on CUDA, memory-efficient in float32, the CPU kernel on CPU),
    'auto' the fastest of these that runs here, by the published order for the GPU (fa3, cudnn,
    fa4, flash, sdpa on Hopper; the start-up line names what runs and why faster ones were
    skipped). The planner traces the CUDA kernels; 'auto' plans fa3."""
    fsdp_reshard_after_forward: bool = True
    """Free gathered parameters after each block's forward (re-gathered in backward)."""
    style_options: StyleOptionValues = field(default_factory=StyleOptionValues)
    """cp_style's own options, as [parallelism] keys (listed below by style)."""

    @property
    def world_size(self) -> int:
        """The processes the job asks for: context_parallel_degree x tensor_parallel_degree x
        data_parallel_shard_degree (x 1 when the dp degree is -1, 'every rank launched')."""
        return (
            self.context_parallel_degree
            * self.tensor_parallel_degree
            * max(self.data_parallel_shard_degree, 1)
        )

    @property
    def style(self) -> registry.StyleSpec:
        """The registered style ``cp_style`` names (``parallel.registry``); ConfigError listing
        the registered names when it names none."""
        try:
            return registry.style_spec(self.cp_style)
        except ValueError as err:
            raise ConfigError(f"[parallelism] {err}") from None

    @property
    def options(self) -> StyleOptions:
        """cp_style's options: the ones set, the style's defaults for the rest (``check_job``
        refuses, naming the file, an option the style does not take)."""
        try:
            return self.style.options_from(self.style_options)
        except OptionError as err:
            raise ConfigError(f"[parallelism] {err}") from None

    @property
    def head_degree(self) -> int:
        """C_h, the ranks that exchange heads by all-to-all (the options': C / ring_degree, 1 for
        ring attention)."""
        return self.options.head_degree(self.context_parallel_degree, self.ring_degree)

    def stage_heads(self, n_heads: int) -> int:
        """U resolved for a model of ``n_heads`` query heads (the options')."""
        return self.options.stage_heads(n_heads, self.head_degree)

    def with_style_options(self, **values: Any) -> Parallelism:
        """A copy with these style options set (None: unset, the style's default)."""
        merged = {**self.style_options, **values}
        kept = {key: value for key, value in merged.items() if value is not None}
        return replace(self, style_options=StyleOptionValues(kept))


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full"] = "none"
    """'full' recomputes each TransformerBlock in backward, keeping only its input."""
    cpu_offload: bool = False
    """Keep the checkpointed block inputs in host memory (async pinned copies, prefetched)."""
    keep_attention: Literal["none", "host", "device"] = "none"
    """Keep each layer's attention output and LSE from forward so the recompute in backward
    skips the attention (about a quarter of a long-context step): 'device' holds them on the GPU
    (per layer S/C x n_heads x head_dim x 2 bytes plus the LSEs), 'host' in host memory, fetched
    back during the recompute; 'none' recomputes attention. Needs mode = 'full'."""
    keep_attention_skip_first: int = 0
    """The first N blocks recompute their attention anyway, the others keep it: where the kept
    outputs of every layer do not fit (Llama3-8B at 5M: 5 GiB per layer per GPU), the last
    layers keep theirs, which backward takes first, so the kept memory drains from its start."""
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
    accept_data_change: bool = False
    """Resume although the training data changed since the snapshot (files added, removed or
    modified, or the documents already read differ): the loader continues at the saved document
    index of the data as it is now. Off: such a resume is refused, naming what changed."""
    accept_model_change: bool = False
    """Resume, convert or evaluate a snapshot although its recorded RoPE settings (rope_theta,
    rope_scaling's factor, frequency band and original_max_position_embeddings) differ from this
    job's: on purpose, e.g. a larger rope_theta or scaling factor to extend the context. The
    family, shape, head layout, vocabulary and norm epsilon make another model and are refused
    either way. Off: any difference is refused, naming each differing setting."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Log a metrics line every this many steps (every step's scalars go to the sinks)."""
    enable_tensorboard: bool = True
    """Write the same scalars as tensorboard events."""
    save_tb_folder: str = "tb"
    """Sub-folder of job.dump_folder for tensorboard events."""
    enable_jsonl: bool = False
    """Append the same scalars, one JSON object per step, to save_jsonl_file."""
    save_jsonl_file: str = "metrics.jsonl"
    """File under job.dump_folder for the JSON lines."""
    enable_wandb: bool = False
    """Log the same scalars to a Weights & Biases run (needs pip install wandb; the project is
    $WANDB_PROJECT, else upipe-dtensor; wandb's own WANDB_* variables apply)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each TransformerBlock (fullgraph); every block runs one compiled graph."""
    backend: str = "inductor"
    fuse_tiles: bool = True
    """With ``enable``: also compile the elementwise chains inside the tiled ops (RMSNorm, SwiGLU,
    RoPE: the memory-bound work a compiled block cannot fuse, since it calls those ops as opaque
    nodes) into fused kernels (``kernels.fused``); a few more graphs to compile at start-up (two
    per chain where the last tile is shorter)."""


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
    """Where each non-default key was set: ``"section.key"`` -> a file path or ``"command
    line"``."""
    files: list[str] = field(default_factory=list)
    """The job file and the files it extends, base first, as ``sources`` names them."""

    def source_of(self, *keys: str) -> str:
        """The file(s) or the command line that set these ``"section.key"`` values, so an error
        blames where the user wrote the value (defaults are blamed on the job file)."""
        found = dict.fromkeys(self.sources[key] for key in keys if key in self.sources)
        return " and ".join(found) or self.config_file or "defaults"

    def value(self, key: str) -> Any:
        """The value of ``"section.key"``: a section's field, or a style option of
        ``[parallelism]`` (as set, else cp_style's default)."""
        section, name = key.split(".")
        if section == "parallelism" and name in StyleOptionValues.types():
            return getattr(self.parallelism.options, name, self.parallelism.style_options.get(name))
        return getattr(getattr(self, section), name)

    def with_values(self, values: Mapping[str, Any]) -> JobConfig:
        """A copy with these ``"section.key"`` values: sections' fields, or ``[parallelism]`` style
        options (None unsets one: the style's default)."""
        config = self
        for key, value in values.items():
            section, name = key.split(".")
            if section == "parallelism" and name in StyleOptionValues.types():
                changed = config.parallelism.with_style_options(**{name: value})
            else:
                changed = replace(getattr(config, section), **{name: value})
            config = replace(config, **{section: changed})
        return config

    def set_after(self, key: str, other: str) -> bool:
        """Whether ``key`` was set where ``other`` was or after it: in the same file, in a file
        extending that one, or on the command line (a base file's value is overridden)."""
        order = [*self.files, "command line"]
        return order.index(self.sources[key]) >= order.index(self.sources[other])
