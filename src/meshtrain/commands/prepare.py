"""``meshtrain prepare``: tokenize text sources once into memory-mapped token shards."""

from __future__ import annotations

import argparse
import sys


def run_prepare(args: argparse.Namespace) -> int:
    """``meshtrain prepare``: see :mod:`meshtrain.data.prepare`."""
    from meshtrain.data.prepare import prepare

    meta = prepare(args.sources, args.out, args.tokenizer, args.text_field, args.workers,
                   progress=sys.stderr.isatty())
    state = "up to date (same sources, tokenizer and field; nothing rewritten)" \
        if meta["up_to_date"] else "prepared"
    print(f"meshtrain prepare: {args.out} {state}: {meta['tokens']} tokens, "
          f"{meta['documents']} documents, {len(meta['shards'])} shards ({meta['dtype']})")
    return 0
