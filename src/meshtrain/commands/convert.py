"""``meshtrain convert``: Hugging Face checkpoints to meshtrain weights and back."""

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
