"""The audit record (docs/audit.md), by what each part serves:

- ``run_chains``: verifying the per-run event chains that ``runs.record`` writes;
- ``entries``: the chained ``AuditEntry`` log of actions outside any run (``audit_record``,
  ``verify_entries``);
- ``heads``: pinned heads (``audit_verify --write-head/--expect-head``);
- ``export``: streaming exports (keyset iteration, events as rows, CSV and JSON lines);
- ``accounts``: sign-ins, lockouts, unlocks and role snapshots of people;
- ``retention``: pruning old terminal runs; archiving and dropping whole months of events;
- ``partitions``: the events' monthly partitions on PostgreSQL (what ``retention`` drops).

What verification does not prove: that a chain was not recomputed wholesale by someone with
write access to the database and this code (the hashes are not signed with a secret), that the
newest audit entries or events were not cut off the end or the tables emptied (nothing after
them links back; compare with a head recorded elsewhere: ``audit_verify --expect-head``),
nor that the record describes what really happened outside the database.
"""
