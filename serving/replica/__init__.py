"""A model replica: one Ray Serve replica runs one vLLM OpenAI server for one model version.

:mod:`~serving.replica.server` is the Serve deployment (the vLLM child process, its endpoint
published for gateways, health, autoscaling load, drain); :mod:`~serving.replica.engine` turns a
model's config into vLLM's command line and environment, which runs under
:mod:`~serving.replica.engine_main` (killed with its replica); :mod:`~serving.replica.placement`
claims CPU cores for engines on a node and pins them; :mod:`~serving.replica.routers` are the
request routers Serve runs for leases (session affinity).
"""
