"""Shared test helpers: run a function on N gloo ranks, build tiny Llama3 and Qwen3 models,
compare."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from upipe_dtensor.models import get_family, init_sharded_weights
from upipe_dtensor.models.generation import family_module
from upipe_dtensor.parallel import registry
from upipe_dtensor.runtime.errors import end_process
from upipe_dtensor.runtime.parity import (  # noqa: F401 (the tests compare as gpu_check does)
    cast_parameters,
    gather_sequence,
    rel_err,
    shard,
    summed_grads,
)

VOCAB = 64
REPO = Path(__file__).resolve().parents[1]


def run_command(*args: str, processes: int = 0, timeout: float = 300) -> tuple[int, str, str]:
    """``python ARGS`` from the repository root, under ``torchrun --standalone`` with
    ``processes`` ranks when given; in its own process group, killed whole on timeout.
    Returns (exit code, stdout, stderr)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    process = subprocess.Popen(
        [sys.executable, *(launcher if processes else []), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, stdout, stderr


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple) -> None:
    """One rank: ``fn``, then a barrier and the end of the process group, then
    ``errors.end_process(0)``, which skips interpreter shutdown (where gloo threads kept alive by
    torch's caches abort the process although the test passed). The barrier first: every rank is
    done with its collectives, none leaves a peer mid-exchange. On failure the exception still
    goes to ``mp.spawn``.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
        if dist.is_initialized():  # ``fn`` may have ended it itself
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    end_process(0)


# Ranks start from a fork server that imported torch, torchtitan and this package once per test
# session: a spawned rank imports them again (about 10 s on 2 cores), which dominated the
# distributed tests. The server imports before any thread or process group exists, so each fork
# starts as clean as a spawned process (same semantics: nothing of the pytest process is inherited).
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "upipe_dtensor", "harness"])


def run_on_ranks(world_size: int, fn: Callable, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raise failures."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world_size, os.path.join(tmp, "store"), fn, args),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )


def tiny_llama(
    n_heads: int, n_kv_heads: int, seq_len: int, head_dim: int = 8, n_layers: int = 2, seed: int = 0
) -> nn.Module:
    """A small torchtitan Llama3 of the installed generation with deterministic weights
    (identical on every rank); on 0.3.0 with a fused ``wqkv``, as torchtitan's flavors."""
    torch.manual_seed(seed)
    return family_module("llama3").torchtitan_model(
        dim=n_heads * head_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=VOCAB,
        seq_len=seq_len,
    )


def tiny_qwen3(
    n_heads: int, n_kv_heads: int, seq_len: int, head_dim: int = 8, n_layers: int = 2, seed: int = 0
) -> nn.Module:
    """A small torchtitan Qwen3 (QK-norm, rotate-half RoPE) of the installed generation with
    deterministic weights; on 0.3.0 with separate ``wq``/``wk``/``wv``. The norms' weights are
    random too, so their gradients and the QK-norm's scale are exercised."""
    torch.manual_seed(seed)
    model = family_module("qwen3").torchtitan_model(
        dim=n_heads * head_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_dim=3 * n_heads * head_dim,
        vocab_size=VOCAB,
        seq_len=seq_len,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def llama3_attention(
    n_heads: int, n_kv_heads: int, seq_len: int, head_dim: int = 8, seed: int = 0
) -> tuple[nn.Module, tuple, dict]:
    """The attention layer of a one-block Llama3 of this project's ``llama3`` family (its model
    class on the installed generation: separate ``wq``/``wk``/``wv``, RoPE kept as the float64
    frequencies) with torchtitan's initial weights for ``seed``, and the arguments its block
    passes it after ``x`` (``LongContextModel.block_arguments`` without a shard's RoPE table: each
    layer derives it from the frequencies; no mask, no positions): ``layer(x, *args, **kwargs)``
    on either generation, once a CP style is applied (the frequencies are no table torchtitan's
    own attention could read)."""
    family = get_family("llama3")
    args = family.args_class(
        dim=n_heads * head_dim,
        n_layers=1,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=VOCAB,
        max_seq_len=seq_len,
    )
    model = family.model_class(args)
    init_sharded_weights(model, seed=seed, device=torch.device("cpu"))
    call_args, call_kwargs = model.block_arguments(None, None, None)
    return model.layers["0"].attention, call_args, call_kwargs


def make_style(case: dict):
    """The CP style a test case names, made by the registry from its [parallelism] options:
    upipe/ulysses (1-D, or 2D with "ring"), ring, fpdt (UPipe x FPDT when it has a "u"), or any
    registered name."""
    values = {"cp_style": case["style"].removesuffix("2d")}
    if "chunks" in case:
        values["chunk_tokens"] = math.ceil(case["seq_len"] / case["chunks"])
        if case.get("u") is not None:
            values["cp_style"] = "upipe"  # UPipe x FPDT: head stages over sequence chunks
    spec = registry.style_spec(values["cp_style"])
    for key, value in (("heads_per_stage", case.get("u")), ("overlap_stages", case.get("overlap"))):
        if spec.takes(key):
            values[key] = value
    return registry.make_style(values)


def cp_mesh(case: dict, cp: int):
    """A 1-D cp mesh, or the (cp_ring, cp_heads) mesh for a case with a "ring" degree."""
    if "ring" in case:
        return init_device_mesh(
            "cpu", (case["ring"], cp // case["ring"]), mesh_dim_names=("cp_ring", "cp_heads")
        )
    return init_device_mesh("cpu", (cp,))


def case_meshes(case: dict, cp: int):
    """(the cp mesh, the tp mesh or None, this rank's cp group, its cp rank) of a case on
    cp x ``case["tp"]`` ranks, tp innermost as torchtitan lays them out. Without "tp" the cp mesh
    is the whole world (``cp_mesh``; group None: the world's)."""
    tp = case.get("tp", 1)
    if tp == 1:
        return cp_mesh(case, cp), None, None, dist.get_rank()
    ring = case.get("ring")
    cp_shape, cp_names = ((ring, cp // ring), ("cp_ring", "cp_heads")) if ring else ((cp,), ("cp",))
    world = init_device_mesh("cpu", (*cp_shape, tp), mesh_dim_names=(*cp_names, "tp"))
    mesh = world[cp_names]
    flat = mesh._flatten("cp_flat") if ring else mesh
    return mesh, world["tp"], flat.get_group(), flat.get_local_rank()


_REPO = Path(__file__).resolve().parents[1]

# Meta's config.json of Llama-3.1-8B, as published with its weights.
LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


def llama_31_8b_folder(folder: Path) -> str:
    """A stand-in Hugging Face folder: Meta's config.json, the shipped tokenizer, and a weights
    file holding no tensors (the recipes are built on fake tensors: nothing is read, but the
    start-up check parses its header)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(_REPO / "assets/tokenizer" / name, folder / name)
    header = b"{}"
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return str(folder)
