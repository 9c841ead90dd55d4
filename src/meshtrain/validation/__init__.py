"""Everything that refuses a run before launch: the config's sections (:mod:`.run_config`), the
``[model]`` section (:mod:`.model`), and the environment a valid config will run in
(:mod:`.preflight`). The layout rules they apply are :mod:`meshtrain.config.layout_rules`.
"""
