"""Searching layouts: enumerate, keep those that fit, rank (:mod:`.layouts`), plan for an
objective such as time, energy, cost or carbon (:mod:`.objective`), and put a given layout
beside the first choice, term by term (:mod:`.explain`, ``plan --explain``); the offload settings
tried when nothing fits without them (:mod:`.offload`).
"""
