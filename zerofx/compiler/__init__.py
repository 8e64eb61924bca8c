"""The compiler: capture of the training step (``capture``), the compile spine that runs every
stage in order (``pipeline``), the program a compile produces (``program``: ``zerofx.compile``),
meta-device initialisation and the plan cache. It imports ``zerofx.planner.fit`` (the budget
searches the spine runs), config, passes, cost models and below; never the rest of the planner,
the runtime or the applications."""
