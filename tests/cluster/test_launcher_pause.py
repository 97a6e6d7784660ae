"""A paused node is paused when the launcher says so: ``kill(SIGSTOP)`` returns before every
thread of a process has stopped, and a thread still running answers its peers (a node's Raft
thread acknowledged an append after the kill, committing a write to a leader whose followers
were "paused")."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from chronomq.cluster.process.launcher import wait_stopped

# A process whose main thread sleeps (as an event loop waits) while a second thread answers
# datagrams (as the Raft thread answers appends).
ECHO = """
import socket, sys, threading, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
def echo():
    while True:
        data, addr = s.recvfrom(64)
        s.sendto(data, addr)
threading.Thread(target=echo, daemon=True).start()
while True:
    time.sleep(0.01)
"""


def _thread_states(pid: int) -> list[str]:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
        states.append(stat[stat.rindex(")") + 2])
    return states


def test_nothing_answers_once_the_wait_for_a_stop_returns() -> None:
    proc = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.settimeout(10)
            client.sendto(b"ping", ("127.0.0.1", port))
            assert client.recvfrom(64)[0] == b"ping"
            for _round in range(20):
                os.kill(proc.pid, signal.SIGSTOP)
                assert wait_stopped(proc.pid, timeout_s=10)
                assert set(_thread_states(proc.pid)) <= {"T", "t"}
                client.settimeout(0.05)
                client.sendto(b"late", ("127.0.0.1", port))
                try:
                    answer = client.recvfrom(64)[0]
                except TimeoutError:
                    answer = None
                assert answer is None, "a thread answered after the process was paused"
                os.kill(proc.pid, signal.SIGCONT)
                client.settimeout(10)
                assert client.recvfrom(64)[0] == b"late"  # queued while paused, answered now
    finally:
        proc.kill()
        proc.wait()


def test_a_running_process_is_not_reported_stopped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        started = time.monotonic()
        assert not wait_stopped(proc.pid, timeout_s=0.2)
        assert time.monotonic() - started >= 0.2
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_is_gone_is_not_reported_stopped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not wait_stopped(proc.pid, timeout_s=1)
