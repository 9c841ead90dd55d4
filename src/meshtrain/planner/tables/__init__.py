"""Data tables the planner reads: GPU profiles (:mod:`.profiles`), software stacks'
kernel efficiencies (:mod:`.stacks`), model presets (:mod:`.presets`), and the published
training runs the cost model is fitted on (train rows) and checked against (test rows):
:mod:`.runs_megatron` and :mod:`.runs_torchtitan`, assembled and evaluated by
:mod:`.published`, fitted by :mod:`.fitting` (train rows only), ranked by :mod:`.ranks`.
"""
