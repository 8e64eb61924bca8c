"""The applications built on the library: the ``zerofx`` command line (``cli``, and a module per
subcommand in ``commands``), ``zerofx train`` on a genome (``training``), the model a
``MODEL_SPEC`` names (``model_spec``), ``estimate``'s tiers and ``calibrate``'s measurements. The
top layer: it may import every other, and nothing imports it."""
