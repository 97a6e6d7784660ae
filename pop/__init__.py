"""Pop consumption (RocketMQ 5) on the replicated log, revived by the timer through Raft.

A consumer *group* receives messages of a topic; each message handed out is invisible to the
group until it is acked or until its invisible time passes; then it is handed out again with
``delivery_attempt + 1``; after ``max_reconsume_times`` re-deliveries it goes to
``%DLQ%{group}``. RocketMQ 5 does this with a checkpoint ("CK") per pop written through its
timer into a revive topic, an ack record per ack, and ``PopReviveService`` which, when a CK
falls due, re-puts what was not acked. Here the same idea rides on the replicated log, so that
a new leader neither loses an invisible message nor hands out an acked one again.

Where it lives
==============
``pop/`` sits above ``timer`` and ``schedule`` and below ``cluster`` (``cluster -> pop ->
schedule, timer -> raftlog``): it imports nothing of ``cluster``, which uses it through this
module only (the names of ``__all__``). It writes timer messages (:mod:`chronomq.timer.message`'s properties) and names the DLQ as
:mod:`chronomq.schedule.retry` does, and neither of them imports it. It touches the timer only through
the log: it *appends* a timer message to the timer topic in its own apply, and *reads* what the
timer delivered to the revive topic. No import cycle, no call between the two apply
extensions.

=================  =========================================================================
module             owns
=================  =========================================================================
``handle``         receipt handles: encode, HMAC with the cluster secret, decode and verify.
``state``          the replicated state of one (group, topic, queue) and its kv encoding.
``core``           the decisions, pure: pop, ack, change invisible time, revive, forward to
                   the DLQ; ``now_ms`` is an argument (the command's propose time).
``machine``        the apply extension ``pop``: decodes a command, reads the store, runs the
                   core, writes CK timer messages and DLQ copies, stores the state in kv.
``service``        the leader's API (receive, ack, change_invisible, forward_to_dlq) and the
                   revive driver (leader-only work, one piece of :mod:`chronomq.raftlog.leadership`).
``hold``           what retention must keep for pop (``cluster/node/disk.py`` asks it).
``metrics``        Prometheus gauges: held messages, revive lag, what apply did.
=================  =========================================================================

Every node runs it: ``cluster/node/services.py`` starts a :class:`~chronomq.pop.service.PopService`
(``broker.pop``) with the node's ``max_reconsume_times``, ``commit_timeout_ms`` and cluster
secret, and ``pop`` is one of ``cluster.node.reserved.APPLY_EXTENSIONS``.

Replicated state (kv, so snapshots, restarts and catch-up carry it)
==================================================================
Per (group, topic, queue), one kv entry ``pop/q/{group}/{topic}/{queue}`` holding compact JSON:

* ``cursor``: the queue offset of the first message this group has never been handed;
* ``inflight``: offset -> (pop id, attempt, invisible-until ms), what is handed out and not
  acked; at most :data:`chronomq.pop.state.MAX_HELD` entries together with ``revived``;
* ``revived``: offset -> attempt, messages whose invisible time passed un-acked, waiting to be
  handed out again (with that attempt);
* ``acked``: the last :data:`chronomq.pop.state.MAX_ACKED_MEMORY` (offset, pop id) acked, so a
  repeated ack answers "already acked" rather than "expired".

Plus ``pop/revive`` (int): how far the revive topic has been read. The *pop id* of a hand-out
is the Raft index of the command that handed it out (or changed its invisible time): unique,
the same on every replica, and known to apply without the leader choosing it.

Visibility for the next receive is therefore computed from committed state only: ``revived``
first (lowest offset first), then ``[cursor, max_offset)``; an in-flight message is never
visible, even past its invisible time, until its revive has been *applied*. So a message is
never held by two consumers at once, and it comes back only through the revive command.

Commands (``propose_extension("pop", payload)``; payload a JSON object with ``op``)
=================================================================================
``pop``     ``{"g", "t", "qs": [[queue, min_offset], ...], "n", "inv_ms", "mrt", "tags"}``:
            hand out up to ``n`` (<= :data:`chronomq.pop.state.MAX_POP_MESSAGES`) messages,
            taking the queues in the order given (the leader rotates them). ``min_offset`` is
            the leader's retention view of the queue (replicas delete at different moments,
            so apply never asks its own). ``tags`` (or ``null`` for ``*``) filters by the
            ConsumeQueue's tags code: a never-handed-out message of another tag is passed over
            for this group for good, as RocketMQ's pop does, at most
            :data:`chronomq.pop.machine.MAX_FILTER_SCAN` per queue and command. *Apply* picks the offsets from the committed
            state: two receives racing on the leader never pick the same message, and nothing
            the leader guessed can be stale. Each picked message gets pop id = index, attempt
            (1 for a first hand-out, the revived attempt otherwise) and invisible-until =
            propose time + ``inv_ms``. The answer lists them; the leader reads the messages and
            makes the receipt handles.
``ack``     ``{"items": [[g, t, q, offset, pop_id], ...]}``: each answered ``acked`` (in
            flight with that pop id: removed), ``already_acked`` (in the ack memory) or
            ``expired`` (revived, re-handed, sent to the DLQ, or unknown).
``chg``     ``{"items": [[g, t, q, offset, pop_id, inv_ms], ...], "mrt"}``: change the
            invisible time, as RocketMQ's ChangeInvisibleTime: in flight with that pop id ->
            new pop id (this index), invisible-until = propose time + ``inv_ms``, a new CK; the
            old handle is stale from then on (RocketMQ gives a new handle too). Else ``expired``.
``dlq``     ``{"items": [[g, t, q, offset, pop_id], ...]}``: forward to ``%DLQ%{g}`` on demand
            (ForwardMessageToDeadLetterQueue): in flight with that pop id -> copied to the DLQ
            and removed; else ``expired``.
``revive``  ``{"upto": revive_offset}``: read the revive topic from ``pop/revive`` to
            ``upto`` (at most :data:`chronomq.pop.state.MAX_REVIVE_PER_COMMAND` CKs) and act on
            each (below), moving ``pop/revive`` in the same command.

Every command is bounded (items per command, messages per pop, entries per queue), and apply
is total: a malformed payload or item is answered ``invalid`` the same way on every replica.

CK: a timer message to the revive topic
=======================================
Each ``pop`` (per queue with something handed out) and each ``chg`` appends, in the same apply,
one timer message to the timer topic (``rmq_sys_wheel_timer``, queue 0) with ``TIMER_OUT_MS``
= invisible-until, ``REAL_TOPIC`` = :data:`chronomq.pop.state.REVIVE_TOPIC` (``%POP_REVIVE%``),
``REAL_QID`` = 0, a msg id derived from (index, seq) and a JSON body ``{"g", "t", "q", "p":
pop_id, "o": [offsets], "mrt"}``. It is a normal record of the timer topic, so the timer's
apply enqueues it into its wheel and, once the slot is due (never before invisible-until, by
the leader's clock), delivers it to the revive topic, all through Raft like any timer message.
The timer driver wakes on it because the record counts as a message of the timer topic.

The revive driver (leader only) sees the revive topic grow and proposes ``revive``. For each CK
and each offset in it, apply looks at the in-flight entry:

* none, or another pop id: acked, re-handed or changed meanwhile -> nothing (a stale CK);
* same pop id, invisible-until > the command's propose time (a new leader whose clock is
  behind the old one's): re-armed, a new CK due at invisible-until;
* same pop id and due: if ``attempt > mrt`` (the message was delivered ``mrt + 1`` times,
  the original and ``mrt`` re-deliveries, as :mod:`chronomq.schedule.retry` counts) it is copied to
  ``%DLQ%{g}`` (queue 0, ``RECONSUME_TIME`` = attempt, ``RETRY_TOPIC`` = the topic,
  ``ORIGIN_MESSAGE_ID``) and dropped; else it moves to ``revived`` with ``attempt + 1``.

Because the check is "still in flight under this pop id *and* due", a CK can only do what it
would do anyway: a repeated, late or forged CK (the revive topic is an ordinary topic name)
never makes a message visible before its time nor revives an acked one. ``mrt`` travels in the
CK, so every replica uses the limit the leader had when the message was handed out.

Receipt handles (:mod:`chronomq.pop.handle`)
==========================================
Self-contained, so any node (and a new leader after a failover) can act on one without a lookup:
``v1.`` + base64url of (group, topic, queue, offset, pop id, attempt, invisible-until) + a
16-byte HMAC-SHA256 tag keyed from the cluster secret. The edge verifies the tag (a tampered or
foreign handle is refused before anything is proposed); apply decides staleness from the
replicated state (offset + pop id), so a handle from before a failover still acks, and a handle
whose message was revived answers ``expired`` on every replica alike. An ack that arrives after
invisible-until but before the revive is applied is still accepted: the message has not been
handed to anyone else, so this is safe (RocketMQ refuses it by the clock; we answer from state).

Retention
=========
Apply reads a message again when it is handed out again or copied to the DLQ, and reads CKs
from the revive topic; retention keeps both (:mod:`chronomq.pop.hold`, part of
``DiskService.needed_offset``), so every replica reads the same bytes. Never-handed-out
messages are not held, as in RocketMQ. The revive topic ``%POP_REVIVE%`` is a system topic for
producers (``cluster.node.reserved``): only the timer writes to it.

Leader side (:mod:`chronomq.pop.service`)
=======================================
``PopService.receive(group, topic, max_messages, invisible_ms)`` proposes one ``pop`` command
and reads the picked messages from the local store; ``ack``, ``change_invisible`` and
``forward_to_dlq`` verify handles and propose one command each (lists allowed). Answers are
frozen dataclasses and enums. Long polling (``wait_ms``) is left to the gRPC layer: it may
call ``receive`` again when the topic grows (the node's apply listeners already wake pulls).
The revive driver is a piece of leader-only work registered with the node's
:class:`chronomq.raftlog.leadership.Leadership` (``pop-revive``): it proposes only while its term token
is current, one ``revive`` command at a time, and after a failover the new leader resumes from
the committed ``pop/revive``: nothing skipped, nothing revived twice (a second revive of the
same CK finds the entry moved).

Imports ``raftlog``, ``schedule`` and ``timer`` only, never ``cluster``; other packages use
it through this module (``chronomq.pop``), never its modules.
"""

from chronomq.pop.handle import MAX_HANDLE_CHARS, InvalidHandle
from chronomq.pop.hold import lowest_needed_offset
from chronomq.pop.machine import MAX_FILTER_TAGS, group_problem, topic_problem
from chronomq.pop.metrics import install_metrics
from chronomq.pop.service import (
    AckResult,
    ChangeResult,
    ForwardResult,
    PopError,
    Popped,
    PopService,
)
from chronomq.pop.state import (
    MAX_INVISIBLE_MS,
    MAX_ITEMS_PER_COMMAND,
    MAX_POP_MESSAGES,
    MAX_RECONSUME_TIMES_CEILING,
    MIN_INVISIBLE_MS,
    REVIVE_TOPIC,
)

__all__ = [
    "MAX_FILTER_TAGS",
    "MAX_HANDLE_CHARS",
    "MAX_INVISIBLE_MS",
    "MAX_ITEMS_PER_COMMAND",
    "MAX_POP_MESSAGES",
    "MAX_RECONSUME_TIMES_CEILING",
    "MIN_INVISIBLE_MS",
    "REVIVE_TOPIC",
    "AckResult",
    "ChangeResult",
    "ForwardResult",
    "InvalidHandle",
    "PopError",
    "PopService",
    "Popped",
    "group_problem",
    "install_metrics",
    "lowest_needed_offset",
    "topic_problem",
]
