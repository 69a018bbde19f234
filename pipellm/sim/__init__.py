"""Simulation: `pipellm profile` (times real stage steps and fits the cost model), the cost
models, the profiles they read (sim/profiles/ ships two), the virtual clock, and
`pipellm simulate`'s run (simulate/).

See docs/simulation.md for the method and how far to trust it.
"""
