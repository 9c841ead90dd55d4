"""Searching layouts: enumerate, keep those that fit, rank (:mod:`.layouts`), and plan
for an objective such as time, energy, cost or carbon (:mod:`.objective`).
"""
