"""Which attention layout a rank's forward needs for a micro-batch: plain causal, document
masking (``data.document_mask``), context parallelism (``parallel.cp``), or both."""

from __future__ import annotations

from meshtrain.config import Config, ConfigError


def layout_fn(config: Config, mesh, tokenizer):
    """tokens -> the :class:`~meshtrain.model.sequence_layout.SequenceLayout` this rank's
    forward needs (document masking, context parallelism), or None for plain causal."""
    documents = document_layout_fn(config, tokenizer)
    cp, rank = mesh.cp, mesh.cp_rank
    if cp == 1:
        return documents
    from meshtrain.parallel.context import context_layout

    return lambda tokens: context_layout(None if documents is None else documents(tokens),
                                         tokens.shape[1], cp, rank, tokens.device)


def document_layout_fn(config: Config, tokenizer):
    """tokens -> SequenceLayout under ``data.document_mask``, else None."""
    if not config.data.document_mask:
        return None
    eos = tokenizer.eos_id
    if eos is None:
        raise ConfigError(f'data.document_mask = true needs a tokenizer with an eos id to '
                          f'find document boundaries; "{config.data.tokenizer}" has none. '
                          "Use a tokenizer with an eos token or document_mask = false.")
    from meshtrain.model.document_mask import document_layout

    return lambda tokens: document_layout(tokens, eos)
