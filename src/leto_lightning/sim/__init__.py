"""Large-scale simulator: iteration time, failures, per-system recovery costs, interval tuning
and ETTR of Leto and its baselines, up to 131,072 GPUs (``leto simulate``, docs/simulator.md).

It models the runtime and imports nothing from the rest of ``leto_lightning`` but the recipe
schema (``leto_lightning.recipes``, a pure module shared with the trainer) and the error types
(``leto_lightning.errors``).

Modules: ``hardware`` (profiles), ``workload`` (recipes, parameter counts), ``iteration``
(iteration time, memory), ``failures`` (MTTF, HOF share, traces), ``startup`` (start-up and
recovery terms), ``systems`` (cost models), ``spares`` (hot spare nodes and tier 3 for
``leto+spares``), ``ettr`` (analytic + Monte Carlo), ``tuning``,
``report`` (one simulation), ``validation``, ``tables``, ``plots``, ``cli``.
"""
