"""``SequenceLayout``: which positions the tokens of a micro-batch hold and whom they attend to.

The plain model attends causally over a sequence whose token ``i`` sits at rotary position ``i``.
Two features change that, and both reach the attention through one object passed down the blocks:

- document masking (:mod:`meshtrain.model.document_mask`): positions restart at each document and
  a token attends only within its document;
- context parallelism (:mod:`meshtrain.parallel.context`): a rank holds only some chunks of each
  sequence, so its tokens' positions are their places in the whole sequence and their keys are
  the whole sequence's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SequenceLayout(NamedTuple):
    """Rotary ``positions`` of the tokens this rank holds (``[S]``, or ``[B, S]`` when each
    sequence has its own), the attention ``mask`` (bool ``[B, 1, S, S_keys]``, True = may attend,
    or None = causal by position) and ``seq_len``, the length of the whole sequence the
    positions index (the rotary table's size)."""

    positions: torch.Tensor
    mask: torch.Tensor | None
    seq_len: int
