"""The run's record: the one write path (DESIGN §9 "One write path").

- ``checkpoint``: lock the run (or not, on a lease holder's hot path), collect events and
  writes, flush them — with fences, crash and pause points and the audit chain.
- ``rows``: a row's insert or update, as SQL built once per model on PostgreSQL, the ORM
  elsewhere.
- ``transitions``: the moves of a step and its tool call that the engine and operators'
  services share.
- ``configcache``: what the operators configured, kept in-process and read again when the
  generations the claim statement returns say it changed.
"""
