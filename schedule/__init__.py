"""RocketMQ 4.x delay levels: per-level delivery loops with sync or async delivery.

Cores without I/O: :mod:`~chronomq.schedule.levels` (the delay-level table),
:mod:`~chronomq.schedule.planner` (what is due), :mod:`~chronomq.schedule.pending` (the async
pending queue), :mod:`~chronomq.schedule.rewrite` and :mod:`~chronomq.schedule.retry`.
Replicated state: :mod:`~chronomq.schedule.state`. Driving them against the log:
:mod:`~chronomq.schedule.delivery` (what both modes share), :mod:`~chronomq.schedule.sync_delivery`,
:mod:`~chronomq.schedule.async_delivery`, :mod:`~chronomq.schedule.level_loop` (a loop per
level, on the leader only, on the node's leader runtime) and :mod:`~chronomq.schedule.service`
(registration, controls and figures).

Imports ``raftlog`` (and ``chronomq.version``) only; ``pop`` and ``cluster`` build on it.
"""
