"""The node's configuration: the key table (:mod:`.keys`), a node's configuration read from
its file, the environment and overrides (:mod:`.nodeconfig`), and the generated configuration
reference (:mod:`.doc`, with :mod:`.docsection`, which the HTTP reference uses too).

Imports ``raftlog`` and ``schedule`` (the Raft settings, the delay levels), nothing of
``cluster`` outside this package.
"""
