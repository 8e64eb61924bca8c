"""The compiler: capture of the training step (``capture``), the compile spine that runs every
stage in order (``pipeline``), the program a compile produces (``program``: ``zerofx.compile``),
layer folding, the plan search and the plan cache. It imports config, passes, cost models and
below; never the runtime or the applications."""
