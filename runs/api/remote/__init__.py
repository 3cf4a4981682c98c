"""The remote-agent protocol (``runs.remote``) over HTTP, a module for what each part serves:
``lease`` (claim, heartbeat, release) and ``resume`` (the packet a claim answers), ``steps``
(a decision and the run's new state; finish), ``toolcalls`` (propose, dispatch, the pre-send
check, lookups, the receipt), ``waits``; ``common``: what they share. Signals
(``runs.api.signals``) and manifests (``runs.api.agents``) are not the lease holder's.

Every write of the lease holder carries ``fence`` and ``lease_token`` in its body; a stale
fence (or an expired or released lease) is ``409 lease_lost``, another claim's token or
principal ``403 lease_not_yours``, and either changes nothing.
"""
