"""RocketMQ 4.x delay levels: per-level delivery loops with sync or async delivery."""
