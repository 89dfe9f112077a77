"""``sparseloco demo``: a validator and peers as OS processes on this machine, over a chosen store."""
