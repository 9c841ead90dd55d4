"""Fixed-length packing of one token stream into next-token samples, and the held-out tail cut
at a document boundary.

Documents run across sample boundaries (separated by the tokenizer's eos), so no token is wasted
on padding; :func:`hold_out_tail` splits a stream for evaluation without splitting a document.
A stream that carries a loss mask (chat and prompt/completion data, ``data.train_on =
"assistant"``) gives targets of :data:`IGNORE_INDEX` where the mask is 0: every loss (plain and
vocab-parallel cross-entropy, evaluation) skips them and the token counts that normalise the loss
leave them out, so the mask needs nothing else on any parallel axis.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from meshtrain.config import ConfigError
from meshtrain.data.shards import TokenShards

IGNORE_INDEX = -100
"""The target id of a token that is not trained on (PyTorch's cross-entropy default)."""


class PackedDataset:
    """Fixed-length samples cut from one token stream, with next-token targets.

    Sample ``i`` is ``(tokens[i*L : i*L+L], tokens[i*L+1 : i*L+L+1])`` for ``L = seq_len``:
    consecutive non-overlapping windows whose targets are the inputs shifted by one. Documents run
    across sample boundaries (separated by eos), so no token is wasted on padding. Where the
    stream's loss mask is 0 the target is :data:`IGNORE_INDEX` (the inputs are unchanged).
    """

    def __init__(self, tokens: TokenShards | Tensor, seq_len: int):
        if seq_len < 1:
            raise ConfigError(f"train.seq_len = {seq_len} must be at least 1.")
        self.tokens = TokenShards.of(tokens)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        start = index * self.seq_len
        window = self.tokens.window(start, self.seq_len + 1)
        targets = window[1:].copy()
        mask = self.tokens.mask_window(start + 1, self.seq_len)
        if mask is not None:
            targets[~mask] = IGNORE_INDEX
        return torch.from_numpy(window[:-1].copy()), torch.from_numpy(targets)

    def batch(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        """Samples ``indices`` stacked: ``(inputs, targets)``, each ``[len(indices), seq_len]``."""
        length = self.seq_len + 1
        window = np.empty((len(indices), length), dtype=np.int64)
        for row, index in enumerate(indices):
            window[row] = self.tokens.window(index * self.seq_len, length)
        targets = window[:, 1:].copy()
        if self.tokens.has_mask:
            for row, index in enumerate(indices):
                targets[row, ~self.tokens.mask_window(index * self.seq_len + 1, self.seq_len)] = \
                    IGNORE_INDEX
        return torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(targets)


def hold_out_tail(tokens: TokenShards, fraction: float,
                  eos_id: int | None) -> tuple[TokenShards, TokenShards]:
    """Split ``tokens`` into (training, held-out): the held-out part is at least the last
    ``fraction`` of the stream, starting at the beginning of the document the cut falls in (right
    after the eos before it), so no document is split; at the cut itself when the tokenizer has
    no eos or no eos precedes it within 16M tokens."""
    cut = int(len(tokens) * (1 - fraction))
    if eos_id is not None:
        boundary = tokens.rfind(eos_id, cut)
        if boundary >= 0:
            cut = boundary + 1
    return tokens.slice(0, cut), tokens.slice(cut, len(tokens))
