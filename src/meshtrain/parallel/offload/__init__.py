"""Offloaded model states: this rank's ZeRO shard kept in host memory or memory-mapped files
(``parallel.offload``, docs/offload.md). :class:`~meshtrain.parallel.offload.store.OffloadStore`
holds the tensors; :class:`~meshtrain.parallel.data.offloaded.OffloadedEngine` puts the engine's
shards in it and :func:`~meshtrain.training.offload_step.streamed_step` steps them."""
