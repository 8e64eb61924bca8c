"""Sequence tiling: the planner that chooses which attention ops, token-wise regions, losses,
convolution spans and weights to tile from the memory estimates, and the rewrite of the forward
that applies it."""
