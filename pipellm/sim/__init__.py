"""Simulation: `pipellm profile` (times real stage steps and fits the cost model), the cost
models, the profiles they read (sim/profiles/ ships two), and the virtual clock.

See docs/simulation.md for the method and how far to trust it.
"""
