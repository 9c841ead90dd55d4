"""Hugging Face interop: ``config.json`` mapping (:mod:`.config`, :mod:`.moe_config`,
:mod:`.rope`), tensor names and layouts (:mod:`.tensors`, :mod:`.moe_tensors`), and loading /
saving whole checkpoints (:mod:`.io`).
"""
