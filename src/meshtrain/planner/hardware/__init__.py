"""The types the planner prices on: a hardware profile and the cluster it makes
(:mod:`.profile`), and kernel efficiencies of a software stack (:mod:`.stack_efficiency`).
Their values are in :mod:`meshtrain.planner.tables`.
"""
