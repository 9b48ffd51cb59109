"""With a document mask, a document's loss has exactly zero gradient with respect to every other
document's input embeddings, under every CP style (2 gloo ranks, documents straddling them)."""

from __future__ import annotations

import pytest
import torch
from harness import VOCAB, cp_mesh, gather_sequence, make_style, run_on_ranks, shard, tiny_llama
from test_equivalence import document_ids
from torch.distributed.tensor.parallel import parallelize_module

pytestmark = pytest.mark.distributed

SEQ_LEN = 16
STYLES = [
    dict(style="upipe"),
    dict(style="ulysses"),
    dict(style="ring"),
    dict(style="fpdt", chunks=2, seq_len=SEQ_LEN),
    dict(style="upipe2d", ring=2),
]


def _isolation(rank: int, cp: int) -> None:
    doc_ids = document_ids(SEQ_LEN)
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN))
    for case in STYLES:
        model = tiny_llama(8, 2, SEQ_LEN)
        style = make_style(case)
        parallelize_module(model, cp_mesh(case, cp), {"layers.*.attention": style})
        embeddings = []
        model.tok_embeddings.register_forward_hook(lambda module, args, out: embeddings.append(out))  # noqa: B023 (used in this iteration)
        logits = model(shard(tokens, rank, cp, style), attention_masks=doc_ids)
        for document in range(int(doc_ids.max()) + 1):
            own = shard(doc_ids, rank, cp, style) == document  # this rank's tokens of the document
            loss = (logits * own.unsqueeze(-1)).sum()
            (grad,) = torch.autograd.grad(loss, embeddings[0], retain_graph=True)
            grad = gather_sequence(grad, style)
            outside, inside = grad[doc_ids != document], grad[doc_ids == document]
            assert torch.count_nonzero(outside) == 0, f"{case}: document {document} leaks"
            assert torch.count_nonzero(inside) > 0, f"{case}: document {document} has no gradient"


def test_no_gradient_crosses_documents() -> None:
    run_on_ranks(2, _isolation)
