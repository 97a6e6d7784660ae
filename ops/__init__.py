"""Operator tooling: log schemas, Spark reports, benchmarks and failover drills.

Imports everything below it (the node packages and the client library); only the
``chronomq`` command (``chronomq.cli``) imports it.
"""
