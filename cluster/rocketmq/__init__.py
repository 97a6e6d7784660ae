"""The RocketMQ 5 gRPC endpoint: ``apache.rocketmq.v2.MessagingService`` on every node.

The protocol's messages come from the ``rocketmq-python-client`` package
(``rocketmq.grpc_protocol``); nothing here copies its ``.proto`` files. Modules, lowest first:

- :mod:`chronomq.cluster.rocketmq.codes`: our errors (``ApiError`` codes, HTTP statuses) to the protocol's
  ``Code`` values;
- :mod:`chronomq.cluster.rocketmq.credentials`: the ``auth_token`` check on a call's metadata;
- :mod:`chronomq.cluster.rocketmq.convert`: a ``SendMessageRequest`` to our produce request, and back;
- :mod:`chronomq.cluster.rocketmq.routes`: the members' gRPC addresses and a topic's route;
- :mod:`chronomq.cluster.rocketmq.service`: the servicer (thin handlers that call into the broker);
- :mod:`chronomq.cluster.rocketmq.endpoint`: the grpcio asyncio server, its limits, TLS and metrics.

It sits beside :mod:`chronomq.cluster.httpapi`, not on it: both call into
:mod:`chronomq.cluster.node` (pop through :mod:`chronomq.cluster.node.popcalls`), and this
package imports ``cluster.node`` and what lies below it, never ``httpapi``, ``process`` or
``cli``.
"""
