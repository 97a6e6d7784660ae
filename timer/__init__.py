"""RocketMQ 5.x arbitrary-time timer (RIP-43): TimerWheel, TimerLog, enqueue and dequeue pipelines.

The modules here are storage and decisions without clocks or threads; the asyncio driver that
feeds them is a thin layer on top. What the driver must do so that nothing is lost, delivered
twice or early, and a committed cancel always wins:

1. **Enqueue in log order on every replica.** Each message of the timer topic (a cancel too)
   goes through :func:`chronomq.timer.enqueue.enqueue` in ConsumeQueue order, with its leader-stamped
   store time as ``now`` and the committed read cursor as it stands at that point of the log.
   Then every replica has the same TimerLog positions and the same wheel. A message planned
   DUE_NOW (its slot already read) is delivered at once by the same apply.
2. **Dequeue on the leader, apply everywhere.** The leader calls
   :meth:`chronomq.timer.dequeue.DequeuePlanner.plan` with its clock and proposes the batch's
   :class:`~chronomq.timer.dequeue.DequeueSpan` (nine integers). Applying the command: first enqueue
   everything of the timer topic committed before it, then
   :meth:`~chronomq.timer.dequeue.DequeuePlanner.replay` the span against the committed cursor; if not
   stale, deliver the DELIVER items (read from the CommitLog by offset), make the cursor the
   span's end, and only then put the REPUT items back into the timer topic (roll count + 1).
   A stale span (another leader moved the cursor) changes nothing; the leader then plans again
   from the committed cursor, as it does on :class:`~chronomq.timer.errors.StaleCursor`.
3. **Cancel.** Resolve the msg_id to the target's deliver time and uniq key, propose; in apply,
   :func:`chronomq.timer.cancel.decide_cancel` gives the answer and says whether to store the cancel
   message (enqueued as a tombstone like any timer message).
4. **Checkpoint.** Periodically :func:`chronomq.timer.checkpoint.persist` (TimerLog fsync, then wheel,
   then checkpoint); on start :func:`chronomq.timer.checkpoint.recover`.

These objects are not thread-safe: enqueue, plan, replay and persist run on one thread or
under one lock.

The driver, following those rules:

- :mod:`chronomq.timer.machine`: the apply extension (:mod:`chronomq.raftlog.extension`) every replica runs for
  a timer command: enqueue, cancels, span replay with deliveries and re-puts.
- :mod:`chronomq.timer.state`: the replicated state in kv (cursor, enqueue offset, TimerLog end, ...).
- :mod:`chronomq.timer.files`: the local TimerLog/wheel/checkpoint and their realignment to that state
  after a restart or a snapshot install.
- :mod:`chronomq.timer.message`: the timer topic's properties, timer message ids, derived records.
- :mod:`chronomq.timer.driver`: the leader's driver (dequeue and enqueue commands), a loop of
  the node's leader runtime.
- :mod:`chronomq.timer.produce`: the produce rewrite into the timer topic, with flow control.
- :mod:`chronomq.timer.service`: the node's timer put together; cancel and switches.

Imports ``raftlog`` (and ``chronomq.version``) only; ``pop`` and ``cluster`` build on it.
"""
