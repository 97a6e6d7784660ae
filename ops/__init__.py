"""Operator tooling: log schemas, Spark reports, benchmarks and failover drills."""
