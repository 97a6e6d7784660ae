"""``chronomq drill``: failover drills. A workload, faults on a schedule, and a checker.

- :mod:`chronomq.ops.drill.history` records every operation as a JSON line (invoke / ok / fail / unknown).
- :mod:`chronomq.ops.drill.workload` produces plain, delay-level and timer messages (some timers
  cancelled) and consumes every queue, over HTTP; :mod:`chronomq.ops.drill.grpc_workload` does the same
  with the official RocketMQ 5 client (``--client grpc``: ``Producer``, ``SimpleConsumer``
  receive and ack).
- :mod:`chronomq.ops.drill.faults` kills, pauses, partitions and skews nodes, each fault bounded in time
  and healed; :mod:`chronomq.ops.drill.netns` puts nodes in network namespaces for partitions;
  :mod:`chronomq.ops.drill.churn` transfers the leadership and removes and re-adds a member, through
  :mod:`chronomq.ops.drill.admin` (admin calls, a watch on the leadership); :mod:`chronomq.ops.drill.context`
  holds what every fault receives.
- :mod:`chronomq.ops.drill.checker` reads the history (queue positions, or receives and acks): lost,
  duplicated, early, unexpected, recovered, redelivered,
  lateness, time to recover after each fault (or each of its disruptions) and time without a
  leader.
- :mod:`chronomq.ops.drill.run` ties them together and is the command.
"""
