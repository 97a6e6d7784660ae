"""Replicated CommitLog: message records, CommitLog segments, ConsumeQueues and the Raft state machine.

Owns the log and everything replicated through it; imports nothing of ours but
``chronomq.version`` (the bottom layer: every other package may import it).
"""
