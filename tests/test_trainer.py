"""train.py's loop on CPU: cp=2 (UPipe, Ulysses, compiled) and tp 2 x cp 2 reproduce cp=1 losses;
kill-and-resume reproduces the uninterrupted run, also when resuming with other cp and tp
degrees; a token folder of the corpus trains and resumes as the text does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import run_on_ranks

from upipe_dtensor.config import parse_args
from upipe_dtensor.data.tokenize import tokenize
from upipe_dtensor.train.trainer import Trainer

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
STEPS = 4


def _config(dump: Path, cp: int, extra: list[str]):
    return parse_args(
        [
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(dump),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            str(STEPS),
            "--lr_scheduler.warmup_steps",
            "2",
            "--parallelism.context_parallel_degree",
            str(cp),
            "--checkpoint.interval",
            "2",
            "--metrics.log_freq",
            "100",
            *extra,
        ]
    )


class _Killed(RuntimeError):
    pass


def _train(rank: int, world: int, dump: str, extra: list[str], kill_at: int, out: str) -> None:
    trainer = Trainer(_config(Path(dump), world, extra))
    # A 2D job really runs on the (cp_ring, cp_heads) mesh, not the flattened cp one.
    assert getattr(trainer.cp_style, "ring_degree", 1) == trainer.config.parallelism.ring_degree
    if kill_at:
        step_once, done = trainer.train_step, []

        def dying_step(microbatches):
            done.append(1)
            if len(done) + trainer.checkpointer.step >= kill_at:
                raise _Killed(f"killed during step {kill_at}")
            return step_once(microbatches)

        trainer.train_step = dying_step
        with pytest.raises(_Killed):
            trainer.train()
        return
    losses = trainer.train()
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def _losses(
    tmp: Path, name: str, cp: int, extra: list[str] = (), kill_at: int = 0, dump: Path | None = None
) -> list[float]:
    out = tmp / f"{name}.json"
    run_on_ranks(cp, _train, str(dump or tmp / name), list(extra), kill_at, str(out))
    return [] if kill_at else json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """Uninterrupted single-process losses (cp = 1)."""
    return _losses(tmp_path_factory.mktemp("ref"), "cp1", 1)


def _assert_close(actual: list[float], expected: list[float], tol: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected), 1):
        assert abs(a - e) <= tol * abs(e), f"step {step}: {a} vs {e}"


MEMORY_STACK = [
    "--activation_checkpoint.mode",
    "full",
    "--activation_checkpoint.cpu_offload",
    "true",
    "--memory.tiled_mlp",
    "true",
    "--memory.tiled_rms_norm",
    "true",
    "--memory.chunked_loss",
    "true",
]
RING = ["--parallelism.cp_style", "ring"]
FPDT = [
    "--parallelism.cp_style",
    "fpdt",
    "--parallelism.chunk_tokens",
    "16",
]  # 4 chunks per rank


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--parallelism.cp_style", "ulysses"],
        ["--compile.enable", "true"],
        RING + MEMORY_STACK,
        FPDT + MEMORY_STACK + ["--compile.enable", "true"],
        ["--parallelism.chunk_tokens", "16"] + MEMORY_STACK,
    ],
    ids=[
        "upipe",
        "ulysses",
        "upipe-compiled",
        "ring-memory-stack",
        "fpdt-memory-stack-compiled",
        "upipe-x-fpdt-memory-stack",
    ],
)
def test_cp2_equals_cp1(tmp_path: Path, reference: list[float], extra: list[str]) -> None:
    _assert_close(_losses(tmp_path, "cp2", 2, extra), reference)
    assert reference[-1] < reference[0]


def test_tensor_parallel_under_cp2_equals_cp1(tmp_path: Path, reference: list[float]) -> None:
    """tp 2 x cp 2 (4 processes) with UPipe, the memory stack (tiled MLP and RMSNorm on the
    tensor-parallel weights, chunked loss on each rank's sequence-parallel tokens, full
    checkpointing with host offload) and compiled blocks: the losses of cp = 1."""
    tp = ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    extra = [*MEMORY_STACK, "--compile.enable", "true", *tp]
    _assert_close(_losses(tmp_path, "tp2", 4, extra), reference)


def test_the_qwen3_debug_job_trains_on_two_ranks(tmp_path: Path) -> None:
    """train_configs/qwen3_debug.toml, the Llama3 debug job's Qwen3 twin, trains on 2 CPU ranks
    (its numbers against transformers' Qwen3: test_hf_qwen3.py)."""
    qwen3 = ["--config", str(REPO / "train_configs/qwen3_debug.toml")]  # the last --config wins
    assert _config(tmp_path, 2, qwen3).model.name == "qwen3"
    losses = _losses(tmp_path, "qwen3", 2, qwen3)
    assert len(losses) == STEPS and losses[-1] < losses[0]


def test_two_d_cp4_as_2x2_equals_cp1(tmp_path: Path, reference: list[float]) -> None:
    """2D UPipe on 4 ranks, (cp_ring, cp_heads) = (2, 2): the head all-to-all inside a pair, ring
    attention across the pairs, and the ring-balanced token layout through the whole trainer."""
    _assert_close(_losses(tmp_path, "cp4", 4, ["--parallelism.ring_degree", "2"]), reference)


def test_kill_and_resume(tmp_path: Path, reference: list[float]) -> None:
    dump = tmp_path / "job"
    _losses(tmp_path, "first", 1, kill_at=3, dump=dump)  # snapshot at step 2, dies in step 3
    (dump / "checkpoint" / "step-3.partial").mkdir()  # a save that was cut off: must be ignored
    resumed = _losses(tmp_path, "second", 1, dump=dump)
    assert resumed == reference[2:]  # CPU float32 is deterministic: bit-identical


def test_token_folder_trains_and_resumes_as_the_text(
    tmp_path: Path, reference: list[float]
) -> None:
    """The corpus tokenized once (python -m upipe_dtensor.tokenize), killed in step 3 and resumed
    from its step-2 snapshot (a position, not a replay), gives the text's losses bit for bit
    (steps 1-2 shaped the weights that steps 3-4 report on)."""
    tokens = tmp_path / "tokens"
    tokenize(str(REPO / "train_configs/debug_model.toml"), [], str(tokens), workers=1)
    data = ["--training.dataset_path", str(tokens)]
    dump = tmp_path / "job"
    _losses(tmp_path, "first", 1, data, kill_at=3, dump=dump)
    assert _losses(tmp_path, "second", 1, data, dump=dump) == reference[2:]


def test_resume_with_other_cp_and_tp_degrees(tmp_path: Path, reference: list[float]) -> None:
    """A snapshot of one rank resumes on cp 2 x tp 2: the weights and the optimizer state are
    resharded onto tensor-parallel shards (DCP), the trajectory goes on."""
    dump = tmp_path / "job"
    _losses(tmp_path, "first", 1, kill_at=3, dump=dump)
    tp = ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    _assert_close(_losses(tmp_path, "second", 4, tp, dump=dump), reference[2:])


def test_resume_with_another_style(tmp_path: Path, reference: list[float]) -> None:
    """A snapshot written by ring attention resumes under FPDT: the layout is not in the state."""
    dump = tmp_path / "job"
    _losses(tmp_path, "first", 2, RING, kill_at=3, dump=dump)
    _assert_close(_losses(tmp_path, "second", 2, FPDT, dump=dump), reference[2:])


def test_gradient_accumulation_equals_the_whole_batch(
    tmp_path: Path, reference: list[float]
) -> None:
    """Two micro-batches of 1 sequence see the same 2 sequences as one batch of 2 (packed data)."""
    extra = ["--training.local_batch_size", "1", "--training.gradient_accumulation_steps", "2"]
    _assert_close(_losses(tmp_path, "accum", 1, extra), reference)
