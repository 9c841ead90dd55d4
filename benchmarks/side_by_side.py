"""Each side's step phase by phase, meshtrain's trainer and its peer (DDP, ``Schedule1F1B``) in
the same processes, alternating (:mod:`meshtrain.commands.bench.side_by_side`).

``python benchmarks/side_by_side.py [--suite dp] [--suite pp] [--rounds 10] [--warmup 2]
[--set KEY=VALUE]``
"""

from meshtrain.commands.bench.side_by_side import main

if __name__ == "__main__":
    raise SystemExit(main())
