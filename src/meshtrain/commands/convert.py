"""``meshtrain convert`` and ``meshtrain prepare``: the bodies of the two file-conversion
commands (Hugging Face checkpoints; text to token shards)."""

from __future__ import annotations

import argparse
import sys


def run_convert(args: argparse.Namespace) -> int:
    """``meshtrain convert --from-hf HF_DIR | --to-hf DIR --out DIR``."""
    from meshtrain.checkpoint.hf.io import convert_from_hf, convert_to_hf, parse_dtype

    dtype = parse_dtype(args.dtype) if args.dtype else None
    if args.from_hf:
        out = convert_from_hf(args.from_hf, args.out, dtype)
    else:
        out = convert_to_hf(args.to_hf, args.out, dtype, int(args.max_shard_gb * 2**30))
    print(f"meshtrain convert: wrote {out}", file=sys.stderr)
    return 0


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
