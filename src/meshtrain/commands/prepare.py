"""``meshtrain prepare``: tokenize text sources once into memory-mapped token shards."""

from __future__ import annotations

import argparse
import sys


def run_prepare(args: argparse.Namespace) -> int:
    """``meshtrain prepare``: see :mod:`meshtrain.data.prepare`."""
    from meshtrain.data.prepare import prepare

    meta = prepare(args.sources, args.out, args.tokenizer, args.text_field, args.workers,
                   progress=sys.stderr.isatty(), data_format=args.data_format,
                   chat_template=args.chat_template)
    state = "up to date (same sources, tokenizer, field and format; nothing rewritten)" \
        if meta["up_to_date"] else "prepared"
    masked = f", {meta['data_format']} with a loss mask" if meta.get("loss_mask") else ""
    print(f"meshtrain prepare: {args.out} {state}: {meta['tokens']} tokens, "
          f"{meta['documents']} documents, {len(meta['shards'])} shards ({meta['dtype']}{masked})")
    return 0
