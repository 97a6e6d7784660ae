"""One node's runtime around its replicated log: the broker (produce, pull, offsets, retry,
membership, the cluster view), the leader-only services, disk retention and the produce guard,
lookups, the typed requests both protocols decode into (:mod:`.models`) and their errors
(:mod:`.errors`), the bearer token, TLS, requests to peers, replicated runtime config and the
node's metrics.

Imports ``raftlog``, ``schedule``, ``timer``, ``pop`` (through ``chronomq.pop``),
``cluster.config`` and ``cluster.logs``; never the protocols above it (``httpapi``,
``rocketmq``), ``process`` or ``cli``.
"""
