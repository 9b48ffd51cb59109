"""Qwen3-MoE against ``transformers``' own ``Qwen3MoeForCausalLM`` with the same weights: a tiny
random model (8 experts, top 2, renormalised scores, random norm weights) loaded from a folder
transformers wrote, on 2 gloo ranks under UPipe and Ulysses, causal and with packed documents:
logits, every gradient (the router's and each expert's included) and the per-expert token
counts that drive the load balancing, all in float32, with the MoE blocks whole or tiled over
tokens (``[memory] tiled_mlp``). No token is dropped (every token reaches
its top-k experts, as in transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import gather_sequence, rel_err, run_on_ranks
from hf_tiny import SEQ_LEN, random_tokens, safetensors_weights, save_with_random_norms
from test_hf import _job as hf_job
from test_trainer import REPO
from test_trainer import _config as _trainer_config
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from upipe_dtensor import convert
from upipe_dtensor.config import ConfigError, check_job, parse_args
from upipe_dtensor.models import family_of
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.train.build import build_parallel_model, load_initial_weights
from upipe_dtensor.train.trainer import Trainer

pytestmark = pytest.mark.e2e

EXPERTS, TOP_K, MOE_HIDDEN = 8, 2, 48
MOE_DEBUG = REPO / "train_configs/qwen3_moe_debug.toml"


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    """Random tiny Qwen3-MoE (GQA 4:2, head_dim 32, 2 blocks of 8 experts) saved by
    transformers, with the shipped tokenizer."""
    config = Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=MOE_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    return save_with_random_norms(Qwen3MoeForCausalLM(config).float(), folder)


def _hf_grads(model: Qwen3MoeForCausalLM) -> dict[str, torch.Tensor]:
    """transformers' gradients by their Hugging Face checkpoint names: its fused experts
    (``gate_up_proj``, ``down_proj``) split per expert, as the checkpoint stores them."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach()
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for expert in range(grad.shape[0]):
                gate, up = grad[expert].chunk(2, dim=0)
                grads[f"{base}{expert}.gate_proj.weight"] = gate
                grads[f"{base}{expert}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for expert in range(grad.shape[0]):
                grads[f"{base}{expert}.down_proj.weight"] = grad[expert]
        else:
            grads[name] = grad
    return grads


def _reference(folder: Path, rows: list[torch.Tensor], probe: torch.Tensor):
    """transformers' logits of ``rows`` (each run on its own: a packed row's documents), its
    gradients of sum(logits * probe), and each block's tokens per expert."""
    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    counts = [torch.zeros(EXPERTS) for _ in model.model.layers]

    def count(index: int):
        def hook(module, inputs, output) -> None:
            counts[index] += torch.bincount(output[2].flatten(), minlength=EXPERTS).float()

        return hook

    for index, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(count(index))
    logits = torch.cat([model(row[None]).logits for row in rows], dim=1)
    (logits * probe).sum().backward()
    return logits.detach(), _hf_grads(model), torch.stack(counts)


def _on_ranks(rank: int, world: int, dump: str, hf: str, cases: list) -> None:
    failures = []
    for style, documents, tiled, ep, tokens, probe, expected, grads, counts in cases:
        extra = ["--parallelism.cp_style", style, "--checkpoint.enable", "false"]
        extra += ["--parallelism.expert_parallel_degree", str(ep)]
        if tiled:  # 3 tiles of 11 tokens per rank
            extra += ["--memory.tiled_mlp", "true", "--memory.mlp_tile_tokens", "11"]
        if documents:
            extra += ["--training.attention_mask", "document"]
            extra += ["--training.position_ids", "document"]
        built = build_parallel_model(
            hf_job(Path(dump), Path(hf), "--model.name", "qwen3_moe", *extra)
        )
        load_initial_weights(built)
        logits = built(built.shard_sequence(tokens), **built.document_inputs(tokens))
        (logits * built.shard_sequence(probe)).sum().backward()
        errors = {"logits": rel_err(gather_sequence(logits.detach(), built.cp_style), expected)}
        # FSDP averages the gradients over its ranks; the reference's are the sum.
        ours = {
            name.replace("_checkpoint_wrapped_module.", ""): world * p.grad.full_tensor()
            for name, p in built.model.named_parameters()
        }
        adapter = family_of(built.model.model_args).state_dict_adapter(built.model.model_args, None)
        ours = adapter.to_hf(ours)
        assert sorted(ours) == sorted(grads), sorted(set(ours) ^ set(grads))
        errors |= {f"grad {name}": rel_err(ours[name], grads[name]) for name in grads}
        tokens_per_expert = torch.stack(
            [block.moe.tokens_per_expert_E.clone() for block in built.model.layers.values()]
        )
        dist.all_reduce(tokens_per_expert)
        # Each tile's recompute counts its tokens again (memory.tiled_moe).
        expected_counts = counts * (2 if tiled else 1)
        assert torch.equal(tokens_per_expert, expected_counts), (style, tokens_per_expert, counts)
        worst = max(errors, key=errors.get)
        if errors[worst] > 1e-4:
            failures.append(f"{style} {documents=} {tiled=} {ep=}: {worst} {errors[worst]:.2e}")
        if rank == 0:
            print(
                f"Qwen3-MoE {style} {documents=} {tiled=} {ep=}: worst {worst} {errors[worst]:.2e}"
            )
    assert not failures, "\n".join(failures)


def test_logits_every_gradient_and_expert_counts_equal_transformers(
    tmp_path: Path, moe_folder: Path
) -> None:
    tokens = random_tokens(1)
    first, second = random_tokens(1, 20, seed=4)[0], random_tokens(1, SEQ_LEN - 20, seed=5)[0]
    first[-1] = 1  # EOS: the document boundary
    packed = torch.cat([first, second])[None]
    probe = torch.randn(1, SEQ_LEN, 2048, generator=torch.Generator().manual_seed(7))
    causal = _reference(moe_folder, [tokens[0]], probe)
    documents = _reference(moe_folder, [first, second], probe)
    cases = [
        ("upipe", False, False, 1, tokens, probe, *causal),
        ("ulysses", False, True, 1, tokens, probe, *causal),
        ("upipe", True, False, 1, packed, probe, *documents),
        ("upipe", False, False, 2, tokens, probe, *causal),
        ("ulysses", True, True, 2, packed, probe, *documents),
    ]
    run_on_ranks(2, _on_ranks, str(tmp_path), str(moe_folder), cases)


def _train(rank: int, world: int, dump: str, out: str, extra: list[str]) -> None:
    config = _trainer_config(Path(dump), world, ["--config", str(MOE_DEBUG), *extra])
    trainer = Trainer(config)
    losses = trainer.train()
    biases = [block.moe.expert_bias_E.tolist() for block in trainer.model.layers.values()]
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "biases": biases}))


def _run(tmp: Path, name: str, cp: int, *extra: str) -> dict:
    out = tmp / f"{name}.json"
    run_on_ranks(cp, _train, str(tmp / name), str(out), list(extra))
    return json.loads(out.read_text())


def test_the_moe_debug_job_trains_and_balances_its_experts_as_on_one_rank(tmp_path: Path) -> None:
    """train_configs/qwen3_moe_debug.toml (UPipe) on 2 ranks, and one rank's step-2 snapshot
    resumed on 4 with the experts over ep 2 (each expert FSDP-sharded over the 2 groups) and the
    blocks compiled (the attention halves; the MoE halves eager): the losses of one rank within
    1e-5 and falling, and the same expert biases after 4 steps of torchtitan's load balancing
    (each step's tokens per expert summed over the ranks), which did move them."""
    one = _run(tmp_path, "cp1", 1)
    resumed = tmp_path / "cp4-ep2"  # the one-rank job's folder as it was after step 2
    shutil.copytree(tmp_path / "cp1", resumed)
    shutil.rmtree(resumed / "checkpoint" / "step-4")
    ep = ("--parallelism.expert_parallel_degree", "2", "--compile.enable", "true")
    for run, first in ((_run(tmp_path, "cp2", 2), 1), (_run(tmp_path, "cp4-ep2", 4, *ep), 3)):
        expected = one["losses"][first - 1 :]
        for step, (a, e) in enumerate(zip(run["losses"], expected, strict=True), first):
            assert abs(a - e) <= 1e-5 * abs(e), f"step {step}: {a} vs {e}"
        assert run["biases"] == one["biases"]
    assert one["losses"][-1] < one["losses"][0]
    assert all(any(bias) for bias in one["biases"])


def test_hf_to_dcp_to_hf_is_bit_exact_and_loads_in_transformers(
    tmp_path: Path, moe_folder: Path
) -> None:
    assert convert.main(["--to", "dcp", str(moe_folder), str(tmp_path / "dcp")]) == 0
    back = tmp_path / "hf"
    to_hf = ["--to", "hf", str(tmp_path / "dcp"), str(back), "--model.name", "qwen3_moe"]
    to_hf += ["--model.flavor", "hf", "--model.hf_assets_path", str(moe_folder)]
    assert convert.main(to_hf) == 0
    original, exported = safetensors_weights(moe_folder), safetensors_weights(back)
    assert sorted(exported) == sorted(original)
    for name, weight in original.items():
        assert torch.equal(exported[name], weight), name
    tokens = random_tokens(1)
    models = [
        Qwen3MoeForCausalLM.from_pretrained(f, dtype=torch.float32) for f in (back, moe_folder)
    ]
    with torch.no_grad():
        assert torch.equal(models[0](tokens).logits, models[1](tokens).logits)


def test_tensor_parallelism_is_refused_in_one_line() -> None:
    config = parse_args(["--config", str(MOE_DEBUG), "--parallelism.tensor_parallel_degree", "2"])
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree = 2: the qwen3_moe family's"):
        check_job(config, world_size=4)


def test_an_export_says_the_expert_biases_it_leaves_out() -> None:
    """Qwen3MoeForCausalLM has no place for torchtitan's load-balancing biases, which move each
    token's choice of experts: an export with any nonzero says so, one without says nothing."""
    args = model_args(parse_args(["--config", str(MOE_DEBUG)]).model, 64)
    with torch.device("meta"):
        model = family_of(args).model_class(args)
    note = family_of(args).hf_export_note
    for block in model.layers.values():
        block.moe.expert_bias_E = torch.zeros(args.num_experts)
    assert note(model) == ""
    block.moe.expert_bias_E[3] = -0.25
    assert "biases (largest 0.25) are not part of Qwen3MoeForCausalLM" in note(model)
