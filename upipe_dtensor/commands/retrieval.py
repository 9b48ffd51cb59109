"""Retrieval at every depth and length: passkey retrieval and needle in a haystack, scored under
the job's context parallelism (``python -m upipe_dtensor.evaluate --task passkey|needle``).

    torchrun --nproc_per_node 8 -m upipe_dtensor.evaluate \\
        --config recipes/llama3_8b_extend_1M.toml --model.hf_assets_path $HF \\
        --task needle --lengths 128K,512K,1M --depths 0,0.25,0.5,0.75,1

A prompt of L tokens (L from --lengths, K = 1024 and M = 1024 * 1024 tokens; default the job's
seq_len) is BOS, an instruction, haystack text with the needle inserted ``depth`` of the way
through it (0: first, 1: last; moved back to a sentence start, as NIAH does), the question, and
the answer. ``passkey`` is LongLoRA's and
Landmark Attention's task ("The pass key is 71432. Remember it. 71432 is the pass key."),
``needle`` RULER's single-needle NIAH ("One of the special magic numbers for {key} is: {value}.").
The haystack is the job's own training documents in order, repeated if they are too short, or
--haystack FILE (.txt/.jsonl/.parquet, read as the loader reads them).

Scoring needs one forward per prompt under the job's CP style, and no KV cache: the answer is
teacher-forced, so one forward over prompt + answer gives the log-probability of every answer token
(``logprob``: their sum, log p(answer | prompt)) and the argmax at every answer position.
``exact_match`` means every such argmax is the answer token: exactly the condition for greedy
decoding to produce the answer, since greedy decoding of answer token i sees tokens 1..i-1 equal
to the answer's whenever those matched (it checks the answer's tokens, not what greedy decoding
would write after them). With --samples N each (length, depth) cell averages N prompts with other
values: ``logprob`` their mean, ``exact_match`` the fraction that matched.

The last stdout line is ``{"task", "scores": [{"length", "depth", "logprob", "exact_match"}],
"heatmap"}``. The heatmap (depth x length, the NIAH convention) and the same record (with the
weights) are written to [job] dump_folder as ``{task}_{weights}.png`` / ``.json``, weights named as
evaluate names them (``step-N``, or ``hf`` / ``dcp`` for the initial weights); --digits sets the
value's length (a tiny model learns one digit in minutes), --overwrite replaces earlier outputs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from upipe_dtensor.checkpointing.outputs import refuse_existing
from upipe_dtensor.checkpointing.snapshots import snapshot_candidates
from upipe_dtensor.commands.eval_common import load_job_model, weights_tag, write_outputs
from upipe_dtensor.config import ConfigError, JobConfig, parse_args
from upipe_dtensor.data.loader import HubDocuments, LocalDocuments, Tokenizer, job_tokenizer
from upipe_dtensor.data.token_files import is_token_folder
from upipe_dtensor.models import IGNORE_INDEX
from upipe_dtensor.train.build import ParallelModel

logger = logging.getLogger(__name__)

DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"
_UNITS = {"": 1, "K": 1024, "M": 1024 * 1024}
OUTPUT_FIX = (
    "an earlier run of this task on the same weights wrote it: pass --overwrite to replace it, "
    "or move it away"
)

_KEYS = ("apple", "river", "violin", "copper", "harbor", "meadow", "lantern", "glacier")
"""Needle keys (RULER draws a word; any word the question can name works)."""


@dataclass(frozen=True)
class Template:
    """A retrieval task's text; ``{key}`` and ``{value}`` are filled per prompt."""

    instruction: str
    needle: str
    question: str
    answer: str
    digits: int
    """The value is a random number of this many digits."""


TASKS = {
    "passkey": Template(
        instruction="There is an important info hidden inside a lot of irrelevant text. Find it "
        "and memorize it. I will quiz you about the important information there.",
        needle=" The pass key is {value}. Remember it. {value} is the pass key.",
        question=" What is the pass key? The pass key is",
        answer=" {value}",
        digits=5,
    ),
    "needle": Template(
        instruction="Some special magic numbers are hidden within the following text. Make sure "
        "to memorize it. I will quiz you about the numbers afterwards.",
        needle=" One of the special magic numbers for {key} is: {value}.",
        question=" What is the special magic number for {key} mentioned in the provided text? "
        "The special magic number for {key} mentioned in the provided text is",
        answer=" {value}",
        digits=7,
    ),
}


@dataclass(frozen=True)
class TaskRequest:
    """What the command line asked for, as written (checked by ``evaluate_task``)."""

    task: str
    lengths: str | None = None
    """Comma-separated token counts (4096, 128K, 1M); None: the job's seq_len."""
    depths: str = DEFAULT_DEPTHS
    haystack: str | None = None
    """A .txt/.jsonl/.parquet file; None: the job's training data."""
    samples: int = 1
    digits: int | None = None
    """Digits of the value to retrieve; None: the task's (passkey 5, needle 7)."""
    overwrite: bool = False
    """Replace this run's heatmap and JSON if they exist (else refused before any work)."""

    def template(self) -> Template:
        """The task's text with the requested value length (ConfigError for unknown input)."""
        if self.task not in TASKS:
            raise ConfigError(f"--task {self.task}: unknown task; choose one of {sorted(TASKS)}")
        if self.digits is None:
            return TASKS[self.task]
        if not 1 <= self.digits <= 18:
            raise ConfigError(f"--digits {self.digits}: use 1 to 18 digits")
        return dataclasses.replace(TASKS[self.task], digits=self.digits)


@dataclass(frozen=True)
class Prompt:
    """One scored sequence: prompt then answer, ``length`` tokens in all."""

    length: int
    depth: float
    tokens: Tensor
    """(length,) int64 token ids; the last ``answer_tokens`` are the answer."""
    answer_tokens: int

    @property
    def answer_start(self) -> int:
        return self.length - self.answer_tokens


@dataclass(frozen=True)
class PromptScore:
    logprob: float
    """log p(answer | prompt), summed over the answer's tokens."""
    predicted: list[int]
    """The argmax token at each answer position (teacher-forced)."""

    def exact_match(self, prompt: Prompt) -> bool:
        return self.predicted == prompt.tokens[prompt.answer_start :].tolist()


def parse_lengths(text: str) -> list[int]:
    """Sorted distinct token counts from "4096,128K,1M" (K = 1024, M = 1024 * 1024)."""
    lengths = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KkMm]?)\s*", item)
        if not match or int(match[1]) == 0:
            raise ConfigError(
                f"--lengths {text}: {item.strip()!r} is not a token count; write positive counts "
                "such as 4096, 128K or 1M (K = 1024, M = 1024 * 1024), separated by commas"
            )
        lengths.append(int(match[1]) * _UNITS[match[2].upper()])
    return sorted(set(lengths))


def parse_depths(text: str) -> list[float]:
    """Sorted distinct needle depths in [0, 1] from "0,0.25,0.5"."""
    depths = []
    for item in text.split(","):
        try:
            depth = float(item)
        except ValueError:
            depth = math.nan
        if not 0 <= depth <= 1:
            raise ConfigError(
                f"--depths {text}: {item.strip()!r} is not a depth in [0, 1] (0: the needle "
                "first in the haystack, 1: last); write e.g. --depths 0,0.25,0.5,0.75,1"
            )
        depths.append(depth)
    return sorted(set(depths))


def check_lengths_split(config: JobConfig, lengths: list[int]) -> None:
    """ConfigError naming every length the job's CP degree cannot split (every layout needs a
    multiple of it, as [training] seq_len does), with the nearest lengths that it can split."""
    cp = config.parallelism.context_parallel_degree
    bad = [length for length in lengths if length % cp]
    if bad:
        fixes = ", ".join(f"{n} -> {max(n // cp, 1) * cp}" for n in bad)
        raise ConfigError(
            f"--lengths: {', '.join(map(str, bad))} token(s) cannot be split over "
            f"context_parallel_degree = {cp}; use multiples of {cp}: {fixes}"
        )


def haystack_documents(config: JobConfig, haystack: str | None) -> Iterable[str]:
    """The documents to fill haystacks with: --haystack's file, else the job's training data."""
    training = config.training
    try:
        if haystack is not None:
            return LocalDocuments(haystack, training.dataset_text_field)
        if training.dataset == "local" and is_token_folder(training.dataset_path):
            raise ValueError(
                f"[training] dataset_path {training.dataset_path!r} is a token folder, and a "
                "haystack is text: pass --haystack FILE (.txt/.jsonl/.parquet), e.g. the text it "
                "was tokenized from"
            )
        if training.dataset == "local":
            return LocalDocuments(training.dataset_path, training.dataset_text_field)
        return HubDocuments(
            training.dataset,
            training.dataset_split,
            training.dataset_text_field,
            config_name=training.dataset_config_name,
        )
    except ValueError as err:
        where = "--haystack" if haystack is not None else config.source_of("training.dataset_path")
        raise ConfigError(f"{where}: {err}") from err


def haystack_tokens(documents: Iterable[str], tokenizer: Tokenizer, count: int) -> list[int]:
    """The first ``count`` tokens of the documents joined by blank lines, repeating them from the
    start if they hold fewer (a small corpus still fills a long haystack)."""
    separator = tokenizer.encode("\n\n")
    tokens: list[int] = []
    for text in documents:
        tokens += tokenizer.encode(text) + separator
        if len(tokens) >= count:
            return tokens[:count]
    if not tokens:
        raise ConfigError("the haystack documents hold no text; pass --haystack FILE with text")
    return (tokens * math.ceil(count / len(tokens)))[:count]


def sentence_start(haystack: list[int], cut: int, periods: set[int]) -> int:
    """``cut`` moved back to just after the last period token before it (the NIAH convention: the
    needle goes between sentences), or kept where no sentence ends before it."""
    for index in range(cut - 1, -1, -1):
        if haystack[index] in periods:
            return index + 1
    return cut


def build_prompt(
    template: Template,
    tokenizer: Tokenizer,
    haystack: list[int],
    length: int,
    depth: float,
    rng: random.Random,
) -> Prompt:
    """BOS, instruction, haystack with the needle at the sentence start at or before ``depth``
    of it, question, answer: ``length`` tokens in all. Pieces are tokenized separately, so the
    needle sits at a known token offset whatever the tokenizer merges."""
    fill = {
        "key": rng.choice(_KEYS),
        "value": rng.randrange(10 ** (template.digits - 1), 10**template.digits),
    }
    head = [tokenizer.bos_id, *tokenizer.encode(template.instruction)]
    needle = tokenizer.encode(template.needle.format(**fill))
    question = tokenizer.encode(template.question.format(**fill))
    answer = tokenizer.encode(template.answer.format(**fill))
    room = length - len(head) - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ConfigError(
            f"--lengths: {length} tokens cannot hold a prompt of this task: its instruction, "
            f"needle, question and answer take {length - room} tokens before any haystack; use "
            f"lengths of at least {length - room}"
        )
    cut = sentence_start(haystack, round(depth * room), set(tokenizer.encode(".")))
    tokens = head + haystack[:cut] + needle + haystack[cut:room] + question + answer
    return Prompt(length, depth, torch.tensor(tokens, dtype=torch.long), len(answer))


def build_prompts(
    task: str,
    template: Template,
    tokenizer: Tokenizer,
    haystack: list[int],
    lengths: list[int],
    depths: list[float],
    samples: int,
) -> list[Prompt]:
    """Every (sample, length, depth) prompt. Each draws its values from its own seed, so a cell's
    prompts are the same whatever other lengths and depths are asked for."""
    return [
        build_prompt(
            template,
            tokenizer,
            haystack,
            length,
            depth,
            random.Random(f"{task}/{length}/{depth}/{sample}"),
        )
        for sample in range(samples)
        for length in lengths
        for depth in depths
    ]


def _answer_forward(built: ParallelModel, prompt: Prompt) -> tuple[Tensor, Tensor, Tensor]:
    """One forward of the prompt with its answer as the only labels: this rank's per-token losses
    (float64), argmax tokens and global positions, all in the style's shard order.

    The argmax is read by a hook on the output layer, which the per-token loss path runs over
    chunks of the shard in order: the (S/C, vocabulary) logits never exist whole.
    """
    inputs = prompt.tokens[None]
    labels = torch.full_like(inputs, IGNORE_INDEX)
    labels[0, prompt.answer_start - 1 : -1] = inputs[0, prompt.answer_start :]
    argmaxes: list[Tensor] = []
    hook = built.model.output.register_forward_hook(
        lambda module, args, logits: argmaxes.append(logits.argmax(-1).flatten())
    )
    try:
        losses = built(
            built.shard_sequence(inputs),
            labels=built.shard_sequence(labels),
            per_token=True,
            **built.document_inputs(inputs),
        )
    finally:
        hook.remove()
    setup = built.setup
    positions = built.cp_style.shard_positions(prompt.length, setup.cp_rank, setup.cp)
    argmax = torch.cat(argmaxes).cpu()
    if argmax.numel() != positions.numel():
        raise RuntimeError(
            f"the output layer ran on {argmax.numel()} tokens, not this rank's {positions.numel()}"
            ": the model's per-token loss path no longer calls model.output on every token"
        )
    return losses[0].double().cpu(), argmax, positions


@torch.no_grad()
def score_prompts(built: ParallelModel, prompts: list[Prompt]) -> list[PromptScore]:
    """Each prompt's answer log-probability and argmax tokens, the same on every rank.

    Data-parallel ranks split the prompts; every rank runs the same number of forwards (FSDP
    gathers parameters over all of them), a rank with none left repeating the shortest prompt
    uncounted. Each answer position is held by one CP rank of one replica, so a sum over all
    ranks assembles the answers.
    """
    setup = built.setup
    offsets = np.cumsum([0] + [p.answer_tokens for p in prompts]).tolist()
    logprobs = torch.zeros(offsets[-1], dtype=torch.float64)
    predicted = torch.zeros(offsets[-1], dtype=torch.int64)
    mine = list(range(setup.dp_rank, len(prompts), setup.dp))
    stand_in = min(range(len(prompts)), key=lambda i: prompts[i].length)
    built.model.eval()
    for step in range(math.ceil(len(prompts) / setup.dp)):
        index = mine[step] if step < len(mine) else None
        prompt = prompts[stand_in if index is None else index]
        losses, argmax, positions = _answer_forward(built, prompt)
        if index is None:
            continue
        answer = positions - (prompt.answer_start - 1)  # predicting position -> answer token
        held = (answer >= 0) & (answer < prompt.answer_tokens)
        slots = answer[held] + offsets[index]
        logprobs[slots] = -losses[held]
        predicted[slots] = argmax[held]
    for tensor in (logprobs, predicted):
        on_device = tensor.to(setup.device)
        dist.all_reduce(on_device)
        tensor.copy_(on_device.cpu())
    return [
        PromptScore(
            logprobs[offsets[i] : offsets[i + 1]].sum().item(),
            predicted[offsets[i] : offsets[i + 1]].tolist(),
        )
        for i in range(len(prompts))
    ]


def cell_scores(prompts: list[Prompt], scores: list[PromptScore]) -> list[dict]:
    """One entry per (length, depth): mean logprob and the fraction of exact matches over its
    samples, ordered by length then depth."""
    cells: dict[tuple[int, float], list[tuple[float, bool]]] = {}
    for prompt, score in zip(prompts, scores, strict=True):
        cells.setdefault((prompt.length, prompt.depth), []).append(
            (score.logprob, score.exact_match(prompt))
        )
    return [
        {
            "length": length,
            "depth": depth,
            "logprob": sum(lp for lp, _ in runs) / len(runs),
            "exact_match": sum(match for _, match in runs) / len(runs),
        }
        for (length, depth), runs in sorted(cells.items())
    ]


def format_length(tokens: int) -> str:
    """128K, 1M, 1.5M, or the plain count when it is not a round number of K."""
    if tokens % 1024:
        return str(tokens)
    if tokens >= 1024 * 1024:
        return f"{tokens / (1024 * 1024):g}M"
    return f"{tokens // 1024}K"


def plot_heatmap(cells: list[dict], path: Path, title: str) -> None:
    """Depth (rows, 0% at the top) x length (columns), as NIAH heatmaps are drawn: greedy exact
    match on the left, p(answer) = exp(logprob) on the right, each cell labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grids = {key: np.zeros((len(depths), len(lengths))) for key in ("exact_match", "logprob")}
    for cell in cells:
        at = depths.index(cell["depth"]), lengths.index(cell["length"])
        for key, grid in grids.items():
            grid[at] = cell[key]
    panels = [
        ("greedy exact match", grids["exact_match"], grids["exact_match"], "{:.2g}"),
        ("p(answer), labelled log p", np.exp(grids["logprob"]), grids["logprob"], "{:.1f}"),
    ]
    width = 2.5 + 1.1 * len(lengths)
    figure, axes = plt.subplots(1, 2, figsize=(2 * width, 1.2 + 0.5 * len(depths)), squeeze=False)
    for ax, (name, colour, labels, text) in zip(axes[0], panels):
        image = ax.imshow(colour, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for (row, col), value in np.ndenumerate(labels):
            ax.text(col, row, text.format(value), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(name, fontsize=10)
        figure.colorbar(image, ax=ax)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def prepare_prompts(request: TaskRequest, overrides: list[str]) -> tuple[JobConfig, list[Prompt]]:
    """The job config (seq_len: the longest prompt) and every prompt; ConfigError before any
    process group: lengths the CP layout cannot split first, then the inputs."""
    template = request.template()
    if request.samples < 1:
        raise ConfigError(f"--samples {request.samples}: use 1 or more prompts per cell")
    config = parse_args(overrides)
    lengths = parse_lengths(request.lengths or str(config.training.seq_len))
    depths = parse_depths(request.depths)
    check_lengths_split(config, lengths)
    config = dataclasses.replace(
        config, training=dataclasses.replace(config.training, seq_len=max(lengths))
    )
    tokenizer = job_tokenizer(config)
    haystack = haystack_tokens(
        haystack_documents(config, request.haystack), tokenizer, max(lengths)
    )
    prompts = build_prompts(
        request.task, template, tokenizer, haystack, lengths, depths, request.samples
    )
    return config, prompts


def output_paths(config: JobConfig, task: str, snapshot: Path | None) -> tuple[Path, Path]:
    """The heatmap and the JSON record, named by the task and the weights (as evaluate's)."""
    stem = Path(config.job.dump_folder) / f"{task}_{weights_tag(config, snapshot)}"
    return stem.with_suffix(".png"), stem.with_suffix(".json")


def evaluate_task(config_file: str, request: TaskRequest, overrides: list[str]) -> None:
    """Score the job's weights on the task; rank 0 writes the heatmap and the JSON record and
    prints the JSON line. Outputs that exist are refused before any work unless overwrite."""
    config, prompts = prepare_prompts(request, ["--config", config_file, *overrides])
    if not request.overwrite:
        folder = Path(config.job.dump_folder) / config.checkpoint.folder
        newest = snapshot_candidates(config, folder)[:1]  # the snapshot to expect
        expected = folder / f"step-{newest[0]}" if newest else None
        refuse_existing(output_paths(config, request.task, expected), OUTPUT_FIX)
    built, snapshot, source = load_job_model(config)
    scores = score_prompts(built, prompts)
    if dist.get_rank() != 0:
        return
    cells = cell_scores(prompts, scores)
    paths = output_paths(config, request.task, snapshot)
    result = {"task": request.task, "scores": cells, "heatmap": str(paths[0])}
    title = (
        f"{request.task}: {weights_tag(config, snapshot)} weights, "
        f"{config.parallelism.cp_style} cp {built.setup.cp}, {request.samples} prompt(s) per cell"
    )
    write_outputs(
        paths,
        {**result, "weights": source},
        lambda path: plot_heatmap(cells, path, title),
        overwrite=request.overwrite,
    )
    logger.info(
        "evaluated %s on %d %s prompts; wrote %s", source, len(prompts), request.task, paths[0]
    )
    print(json.dumps(result), flush=True)  # the command's output: its result, one JSON line
