"""What a node writes about itself: the process log (:mod:`.stdlog`, Python logging as JSON
lines) and the ops logs that ``chronomq report`` reads: their schema (:mod:`.schema`), a writer
that never slows the broker (:mod:`.writer`) and what a node records (:mod:`.nodelogs`).

Imports ``raftlog`` and ``cluster.config``, nothing else of ``cluster``.
"""
