"""What runs a compiled program on each rank: the engine (``zerofx.initialize``), its storage of
shards and optimizer state, offload to host memory and NVMe, checkpoints, rank groups and the
checks that keep ranks in agreement. It imports the compiler, config and below; never ``app``."""
