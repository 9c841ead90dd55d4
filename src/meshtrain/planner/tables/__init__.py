"""Data tables the planner reads: GPU profiles (:mod:`.profiles`), software stacks'
kernel efficiencies (:mod:`.stacks`), model presets (:mod:`.presets`) and published training
runs the cost model is checked against (:mod:`.published`).
"""
