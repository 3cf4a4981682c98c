"""``manage.py bench``: the engine measured side by side with its physical limit.

The no-op agents and tools live in ``agentops.bench.agents`` and are registered only by the bench
command (and the worker processes it starts), never by the app: users never see them.
"""
