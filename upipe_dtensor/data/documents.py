"""Packed documents: which document each token belongs to, and positions that restart per document.

The loader packs ``[BOS] doc [EOS]`` back to back, so a document ends at each EOS and the next one
starts right after it. The numbering is torchtitan's ``block_causal`` rule (the EOS belongs to
the document it ends), so our document mask and torchtitan's flex mask hide the same keys.

With ``[training] attention_mask = "document"`` the model's ``attention_masks`` argument is the
(B, S) int32 tensor of :func:`document_ids` over the **whole** sequence (every CP rank builds the
whole batch from the loader, so no communication is needed): a query sees only earlier keys of its
own document. ``position_ids = "document"`` feeds :func:`document_positions` as RoPE positions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """(B, S) int32: 0 for the first document of each row, +1 after every EOS token."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (batch, seq_len), got shape {tuple(tokens.shape)}")
    ends = (tokens == eos_id).to(torch.int32)
    ids = torch.zeros_like(ends)
    ids[:, 1:] = torch.cumsum(ends[:, :-1], dim=1)
    return ids


def document_ids_from_positions(positions: Tensor) -> Tensor:
    """(B, S) int32 document ids of per-document ``positions``: a document starts where its
    position is 0 (torchtitan 0.3.0's convention: its loaders emit such positions and its masks
    are built from them, ``get_document_mask_mod``), and every row starts one; the inverse of
    ``document_positions``."""
    starts = positions == 0
    starts[:, 0] = True
    return torch.cumsum(starts, dim=1, dtype=torch.int32) - 1


def document_positions(doc_ids: Tensor) -> Tensor:
    """(B, S) int64 position of each token inside its document (0 at every document start)."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values
    return index - first
