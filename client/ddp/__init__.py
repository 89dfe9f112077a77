"""Data-parallel peers: one peer trains on every GPU of its host (``torchrun … sparseloco-peer join``).

``ranks`` (the process group of the peer's processes, commands from rank 0, bounded collectives,
the heartbeat), ``replica`` (rank 0's :class:`~client.window.WindowTrainer` and the loop of the
other ranks), ``launch`` (what ``sparseloco-peer join`` does on each rank under torchrun).
"""
