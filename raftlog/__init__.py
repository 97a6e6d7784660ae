"""Replicated CommitLog: message records, CommitLog segments, ConsumeQueues and the Raft state machine."""
