"""Document masking inside packed samples (``data.document_mask``).

Training packs documents end to end (each followed by the tokenizer's eos), so a sample usually
holds the end of one document and the start of others. With document masking a token attends
only to earlier tokens of its own document (a block-diagonal causal mask) and rotary positions
restart at 0 at each document, so every document is computed exactly as if it ran alone
(Megatron-LM's ``--reset-attention-mask --reset-position-ids``). A document ends with its eos:
the eos belongs to the document it closes and the next token starts a new one.

:func:`document_layout` derives both from a micro-batch's input tokens, so every pipeline stage
(which has the micro-batch's tokens but receives hidden states) and every tensor-parallel rank
computes the same layout without communication. The mask is a dense ``[B, 1, S, S]`` boolean
given to SDPA: S² bytes per sequence (64 MiB at S = 8192).
"""

from __future__ import annotations

import torch

from meshtrain.model.sequence_layout import SequenceLayout


def document_layout(tokens: torch.Tensor, eos_id: int) -> SequenceLayout:
    """The :class:`~meshtrain.model.sequence_layout.SequenceLayout` of input ``tokens`` [B, S]:
    per-token positions ``[B, S]`` and the block-diagonal causal mask ``[B, 1, S, S]`` (see the
    module docstring)."""
    batch, seq = tokens.shape
    is_eos = tokens == eos_id
    starts = torch.zeros_like(is_eos)
    starts[:, 0] = True
    starts[:, 1:] = is_eos[:, :-1]  # the token after an eos starts a document
    index = torch.arange(seq, device=tokens.device).expand(batch, seq)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    segment = starts.long().cumsum(dim=1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
    mask = (segment[:, :, None] == segment[:, None, :]) & causal
    return SequenceLayout(index - first, mask[:, None], seq)
