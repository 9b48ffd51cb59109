"""Qwen3 Hugging Face weights in and out, against ``transformers``' own ``Qwen3ForCausalLM``: a
tiny random model loaded on 2 gloo ranks under UPipe gives transformers' logits, and with
document masking each document's losses; HF -> DCP -> HF is bit-exact and loads back in
transformers; a Qwen3 folder under ``[model] name = "llama3"`` is refused naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import gather_sequence, rel_err, run_on_ranks
from hf_tiny import SEQ_LEN, random_tokens, safetensors_weights, save_with_random_norms
from test_hf import _job as hf_job
from transformers import LlamaConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig

from upipe_dtensor import convert
from upipe_dtensor.commands.evaluate import position_loss_sums
from upipe_dtensor.config import ConfigError, check_job
from upipe_dtensor.models.hf_config import args_from_hf
from upipe_dtensor.train.build import build_parallel_model, load_initial_weights

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    """Random tiny Qwen3 (GQA 4:2, head_dim 32 while hidden / heads = 16, random norm weights
    including QK-norm's) saved by transformers, with the shipped tokenizer."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    config = Qwen3Config(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return save_with_random_norms(Qwen3ForCausalLM(config).float(), folder)


def _reference(folder: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _job(dump: Path, hf: Path, *extra: str):
    """test_hf's job on a Hugging Face folder, for the qwen3 family, saving nothing."""
    return hf_job(dump, hf, "--model.name", "qwen3", "--checkpoint.enable", "false", *extra)


def _on_ranks(rank: int, world: int, dump: str, hf: str, tokens, expected, row, losses) -> None:
    built = build_parallel_model(_job(Path(dump), Path(hf)))
    load_initial_weights(built)
    with torch.no_grad():
        logits = gather_sequence(built(built.shard_sequence(tokens)))
    err = rel_err(logits, expected)
    assert err <= 1e-4, err
    documents = ("--training.attention_mask", "document", "--training.position_ids", "document")
    built = build_parallel_model(_job(Path(dump), Path(hf), *documents))
    load_initial_weights(built)
    doc_err = rel_err(position_loss_sums(built, row)[:-1], losses)
    assert doc_err <= 1e-4, doc_err
    if dist.get_rank() == 0:
        print(f"Qwen3 UPipe cp=2 vs transformers: logits {err:.2e}, document losses {doc_err:.2e}")


def test_logits_and_document_losses_equal_transformers(tmp_path: Path, qwen3_folder: Path) -> None:
    reference = _reference(qwen3_folder)
    tokens = random_tokens(2)
    first, second = random_tokens(1, 20, seed=4)[0], random_tokens(1, SEQ_LEN - 20, seed=5)[0]
    first[-1] = 1  # EOS: the document boundary
    row = torch.cat([first, second])[None]
    with torch.no_grad():
        expected = reference(tokens).logits
        logits = torch.cat([reference(first[None]).logits[0], reference(second[None]).logits[0]])
    losses = torch.nn.functional.cross_entropy(logits[:-1], row[0, 1:], reduction="none")
    run_on_ranks(2, _on_ranks, str(tmp_path), str(qwen3_folder), tokens, expected, row, losses)


def test_hf_to_dcp_to_hf_is_bit_exact_and_loads_in_transformers(
    tmp_path: Path, qwen3_folder: Path
) -> None:
    assert convert.main(["--to", "dcp", str(qwen3_folder), str(tmp_path / "dcp")]) == 0
    back = tmp_path / "hf"
    assert (
        convert.main(
            [
                "--to",
                "hf",
                str(tmp_path / "dcp"),
                str(back),
                "--model.name",
                "qwen3",
                "--model.flavor",
                "hf",
                "--model.hf_assets_path",
                str(qwen3_folder),
            ]
        )
        == 0
    )
    original, exported = safetensors_weights(qwen3_folder), safetensors_weights(back)
    assert sorted(exported) == sorted(original)
    for name, weight in original.items():
        assert torch.equal(exported[name], weight), name
    tokens = random_tokens(1)
    with torch.no_grad():
        assert torch.equal(_reference(back)(tokens).logits, _reference(qwen3_folder)(tokens).logits)


def test_a_qwen3_folder_under_the_llama3_family_names_the_fix(
    tmp_path: Path, qwen3_folder: Path
) -> None:
    config = _job(tmp_path, qwen3_folder, "--model.name", "llama3")
    with pytest.raises(ConfigError, match=r"is a qwen3 model .* set \[model\] name = 'qwen3'"):
        check_job(config, world_size=2)


def test_a_mixture_of_experts_config_relabelled_dense_is_refused_naming_the_field() -> None:
    """transformers' own Qwen3-MoE config.json, relabelled ``qwen3``, would otherwise load as a
    dense Qwen3 with its experts dropped; the dense configs of both families still load."""
    moe = Qwen3MoeConfig(num_hidden_layers=2).to_dict() | {"model_type": "qwen3"}
    with pytest.raises(ValueError, match=r"num_local_experts = 128 configures mixture of experts"):
        args_from_hf(moe, "moe/config.json")
    published = {  # the fields Qwen3-30B-A3B's config.json publishes them by
        key: value for key, value in moe.items() if key != "num_local_experts"
    } | {"num_experts": 128}
    with pytest.raises(ValueError, match=r"num_experts = 128 configures .*qwen3_moe"):
        args_from_hf(published, "moe/config.json")
    sliding = Qwen3Config(layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"layer_types has \['sliding_attention'\]"):
        args_from_hf(sliding.to_dict(), "sliding/config.json")
    for dense in (Qwen3Config(num_hidden_layers=3), LlamaConfig(num_hidden_layers=3)):
        assert args_from_hf(dense.to_dict(), "dense/config.json").n_layers == 3
