"""Training data storage: token shards read through memory maps (see :mod:`.shards`)."""
