"""The node's commands of ``chronomq`` (:mod:`.commands`, :mod:`.timer`), how they print
(:mod:`.output`) and the admin client they talk through (:mod:`.client`).

The top of ``cluster``: imports any of its subpackages, never ``ops`` (``chronomq/cli.py``
assembles the ops commands beside these).
"""
