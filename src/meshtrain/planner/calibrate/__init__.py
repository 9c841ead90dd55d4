"""Calibrating this machine into a hardware profile: collectives, GEMMs and a
reference block measured (:mod:`.measure`), and the block fit (:mod:`.block`).
"""
