"""Train a tiny torchtitan Llama3 with UPipe context parallelism + FSDP2 on synthetic data.

    torchrun --nproc_per_node 2 examples/train_tiny.py

Every rank holds a contiguous 1/C of each sequence; attention sees the whole sequence through
UPipe's per-stage all-to-alls. The data is a family of modular-arithmetic sequences (learnable in
a few dozen steps), so the printed loss visibly falls. The full trainer (TOML configs, real data,
checkpoints, metrics) is ``train.py``'s job; this is the smallest end-to-end use of the style.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

from upipe_dtensor import UlyssesAttention, UPipeAttention


def synthetic_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences x_{t+1} = (x_t + step) mod vocab with a random start and step per row."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    step = torch.randint(1, 8, (batch, 1), generator=generator)
    return (start + step * torch.arange(seq_len + 1)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256, help="global tokens per sequence")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads-per-stage", type=int, default=None, help="U; default C")
    parser.add_argument("--ulysses", action="store_true", help="all heads in one stage")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, cp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.seq_len % cp:
        raise SystemExit(f"--seq-len {args.seq_len} must be divisible by the {cp} processes")

    model_args = TransformerModelArgs(
        dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=64, max_seq_len=args.seq_len
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(model_args)
        with torch.no_grad():
            model.init_weights()

    mesh = init_device_mesh(device.type, (cp,), mesh_dim_names=("cp",))
    style = UlyssesAttention() if args.ulysses else UPipeAttention(heads_per_stage=args.heads_per_stage)
    parallelize_module(model, mesh["cp"], {"layers.*.attention": style})
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    local = args.seq_len // cp
    own = slice(rank * local, (rank + 1) * local)
    generator = torch.Generator().manual_seed(1234)  # same batch on every rank
    tokens_per_step = args.batch * args.seq_len
    for step in range(1, args.steps + 1):
        batch = synthetic_batch(args.batch, args.seq_len, model_args.vocab_size, generator)
        inputs, labels = batch[:, :-1][:, own].to(device), batch[:, 1:][:, own].to(device)
        logits = model(inputs)
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        # FSDP2 averages gradients over the cp ranks; scaling by cp makes the applied gradient
        # that of the global mean loss over all tokens of the step.
        (loss_sum * cp / tokens_per_step).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_sum = loss_sum.detach()
        dist.all_reduce(loss_sum)
        if rank == 0 and (step == 1 or step % 5 == 0):
            print(f"step {step:3d}  loss {loss_sum.item() / tokens_per_step:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
