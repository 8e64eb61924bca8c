"""Sequence parallelism: where the sequence axis runs through a graph (``seq_regions``), the
rewrites that put attention and FFT convolutions in one canonical form, the planner and rewrite
that shard the sequence over a group, and the sequence mixers (attention by Ulysses or ring,
convolutions, scans, flips, declared ops)."""
