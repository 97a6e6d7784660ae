"""One node as an operating-system process: ``chronomq node`` (:mod:`.server`: the node, its
HTTP app and gRPC endpoint, until a signal), bounded shutdown (:mod:`.stopping`), the
file-descriptor budget and malloc settings, and the launcher of local clusters
(:mod:`.launcher`: ``chronomq cluster up``, tests, benches, drills).

Imports ``httpapi``, ``rocketmq`` and everything below them; never ``cli``.
"""
