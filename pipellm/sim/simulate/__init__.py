"""`pipellm simulate`: `bench serve`'s workload against the real engine loop, in virtual time.

Nothing of the engine is copied: `EngineCore` (scheduler, batch queue, output processing)
runs inside the very loop the server's engine process runs (`serve_messages`), with a
`VirtualSimExecutor` for the stages and a `VirtualClock` for time. The only stand-in is
`VirtualClient` (client.py), which plays the API server and `bench serve`'s client. The
figures and table are `bench serve`'s own code.
"""

from pipellm.sim.simulate.run import simulate

__all__ = ["simulate"]
