"""meshtrain: train dense and Mixture-of-Experts transformers across many processes, with every
layout giving the same numbers as one process."""

__version__ = "0.1.0"
