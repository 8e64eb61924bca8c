"""The applications built on the library: the ``zerofx`` command line (``cli``), ``zerofx train``
on a genome (``training``), and the planning tools behind ``zerofx plan``, ``estimate``,
``calibrate`` and ``--sweep``. The top layer: it may import every other, and nothing imports it."""
