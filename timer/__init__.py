"""RocketMQ 5.x arbitrary-time timer (RIP-43): TimerWheel, TimerLog, enqueue and dequeue pipelines."""
