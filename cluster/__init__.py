"""One broker node: its configuration, its runtime around the replicated log, the HTTP API,
the RocketMQ 5 gRPC endpoint, the process that runs it and the node's commands.

Subpackages, lowest first; each imports only the ones below it (and ``raftlog``, ``schedule``,
``timer``, ``pop``), never ``ops`` or ``chronomq.cli`` (``tests/test_layering.py`` checks it):

- ``config``: the key table, loading a node's configuration, the configuration reference;
- ``logs``: the process log and the ops logs that reports read;
- ``node``: the broker, the leader-only services, disk, peers, the typed requests and errors;
- ``httpapi`` and ``rocketmq``: the two client protocols, side by side, on top of ``node``;
- ``process``: ``chronomq node`` as an operating-system process, and the local launcher;
- ``cli``: the node's commands and the admin client they use.
"""
