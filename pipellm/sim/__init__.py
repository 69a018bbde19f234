"""Simulation: profiles of stage step times, a virtual clock, and `pipellm simulate`.

See docs/simulation.md for the cost models and how far to trust them.
"""
