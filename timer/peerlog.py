"""The TimerLog between peers: what this node serves of its own, and completing its own.

A node whose TimerLog is behind the replicated state after a restart or a snapshot install
completes it from a peer over the HTTP API (``GET /v1/admin/timer/log?from=&to=``, answered by
:func:`read_log`, the next position in ``X-Timer-Next``) rather than rebuilding it.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from chronomq.timer.errors import TimerStateError
from chronomq.timer.files import TimerFiles
from chronomq.timer.timerlog import read_records

# The timer service's lines, as before this had a module of its own.
log = logging.getLogger("chronomq.timer.service")

#: Most TimerLog records one fetch answer carries (4 MB).
FETCH_MAX_RECORDS = 50_000

OpenUrl = Callable[[str, float], Any]
"""How a peer's URL is opened (blocking), given the URL and a timeout in seconds."""


def read_log(files: TimerFiles, start: int, end: int) -> tuple[bytes, int]:
    """Records ``[start, end)`` of this node's TimerLog (at most :data:`FETCH_MAX_RECORDS`)
    for a peer completing its own; any thread."""
    have, first = files.log.end_pos, files.log.start_pos
    if end > have:
        raise TimerStateError(f"this node's TimerLog ends at {have}, before {end}")
    if start < first:
        raise TimerStateError(
            f"this node's TimerLog starts at {first} (segments before it were reclaimed), "
            f"after {start}"
        )
    try:
        return read_records(
            files.log.directory, files.log.segment_bytes, start, end, FETCH_MAX_RECORDS
        )
    except FileNotFoundError:
        raise TimerStateError(
            f"this node's TimerLog no longer holds {start}: its segment was just reclaimed"
        ) from None


class PeerLogFetch:
    """Completes the local TimerLog from the peers' HTTP API; gives up after five minutes."""

    def __init__(
        self,
        peer_urls: Callable[[], list[str]],
        open_url: OpenUrl | None,
        stop: threading.Event,
    ) -> None:
        self.peer_urls = peer_urls
        # The node passes an opener that authenticates.
        self.open_url: OpenUrl = open_url or (
            lambda url, timeout_s: urllib.request.urlopen(url, timeout=timeout_s)  # noqa: S310
        )
        self._stop = stop

    def fetch(self, start: int, end: int, sink: Callable[[bytes], None]) -> None:
        """Complete the local TimerLog from peers over their HTTP API (blocking; runs where the
        files are aligned: registration or a snapshot install)."""
        pos = start
        deadline = time.monotonic() + 300
        while pos < end:
            progressed = False
            for url in self.peer_urls():
                query = f"{url}/v1/admin/timer/log?from={pos}&to={end}"
                try:
                    with self.open_url(query, 10) as r:
                        data = r.read()
                        nxt = int(r.headers["X-Timer-Next"])
                except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError) as exc:
                    log.info("TimerLog fetch from %s failed: %s", url, exc)
                    continue
                if nxt <= pos or not data:
                    continue
                sink(data)
                pos = nxt
                progressed = True
                break
            if not progressed:
                if time.monotonic() > deadline:
                    raise TimerStateError(f"no peer could send TimerLog [{pos}, {end})")
                self._stop.wait(0.5)
