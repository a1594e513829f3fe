"""The gateway: the OpenAI-compatible ingress, one Ray Serve deployment with its own listener.

A request passes, in order: :mod:`~serving.gateway.listener` (uvicorn on the gateway port, in
the replica's event loop) -> :mod:`~serving.gateway.routes` (parse the body with
:mod:`~serving.gateway.protocol`, render results and errors) -> :mod:`~serving.gateway.core`
(the per-replica object graph) -> :mod:`~serving.gateway.admission` (API key, tenant limits,
shedding) -> :mod:`~serving.gateway.routing` (model, alias or ``model@version``, weighted
version) -> :mod:`~serving.gateway.replicas` (pick a model replica: directly from the published
endpoints, or a Serve lease) -> :mod:`~serving.gateway.relay` (HTTP to the replica's vLLM
server, bytes streamed back, failover before the first byte).

:mod:`~serving.gateway.deployment` is the Serve deployment that builds this graph and is the
``import_path`` target of the gateway application.
"""
