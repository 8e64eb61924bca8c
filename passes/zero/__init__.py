"""ZeRO sharding: the planners of placements, buckets, prefetch and shard groups, and the rewrites
that shard parameters, gather them (whole or one weight tile at a time), reduce gradients and
all-gather updated shards, then schedule and lower those collectives."""
