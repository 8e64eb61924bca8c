"""The planner's searches, one module per question they answer:

- what fits: the budget searches the compile spine runs (``fit``: the prefetch distance, tiling
  and recompute fitted to ``zerofx.memory_budget``), and the longest sequence or largest batch
  that fits (``solve``, ``zerofx plan --solve``);
- what is fastest: the whole-job search (``autoplan``, over the candidates of ``space``);
- how it scales: the sweep over world sizes (``sweep``), and a deep model planned from cuts of
  2 and 3 of its blocks (``folding``, ``folded_tiling``, ``folded_plan``).

Two layers (NOTE [Layers] in pyproject.toml): ``fit`` sits below ``zerofx.compiler``, which calls
it, and sees candidates only through callbacks; the rest sits above the compiler, which it
calls, and below the runtime, whose ``zerofx.auto`` calls the whole-job search. So this file
imports nothing: importing ``zerofx.planner.fit`` must not bring in the upper part.
"""
