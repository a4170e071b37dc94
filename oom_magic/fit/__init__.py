"""The fit check: what a load needs (from a cell's load calls, the command or ``fit_check``'s
parameters), the budget of each device or deployment target, the verdict and the options that fit.

A new loader is recognised in ``load_calls``; a new deployment GPU goes in ``data/gpus.json``.
"""
