"""``chronomq drill``: failover drills. A workload, faults on a schedule, and a checker.

- :mod:`ops.drill.history` records every operation as a JSON line (invoke / ok / fail / unknown).
- :mod:`ops.drill.workload` produces plain, delay-level and timer messages (some timers
  cancelled) and consumes every queue.
- :mod:`ops.drill.faults` kills, pauses, partitions and skews nodes, each fault bounded in time
  and healed; :mod:`ops.drill.netns` puts nodes in network namespaces for partitions.
- :mod:`ops.drill.checker` reads the history: lost, duplicated, early, unexpected, recovered,
  lateness and time to recover after each fault.
- :mod:`ops.drill.run` ties them together and is the command.
"""
