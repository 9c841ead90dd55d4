"""Where each side's step goes, layout by layout: ``meshtrain bench``'s suites under
``torch.profiler``, one JSON line per suite and side
(:mod:`meshtrain.commands.bench.layout_profile`).

``python benchmarks/layout_profile.py [--suite peers] [--steps 4] [--warmup 2] [--set KEY=VALUE]``
"""

from meshtrain.commands.bench.layout_profile import main

if __name__ == "__main__":
    raise SystemExit(main())
