"""Mount, cut and unmount a power-cut filesystem from a test or a drill.

:class:`PowerCutMount` starts ``python -m ops.drill.powercut`` for one mount point, waits until
it is mounted, and talks to it over its control socket. :meth:`PowerCutMount.stop` always
unmounts, also when the filesystem process died (a dead FUSE process leaves its mount point
answering ENOTCONN until it is unmounted). :func:`available` says why it cannot run here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

START_TIMEOUT_S = 15.0
CONTROL_TIMEOUT_S = 120.0
"""A cut moves every file of the disk; on a busy machine with a large disk that takes a while."""


def available() -> tuple[bool, str]:
    """Whether a power-cut mount can be made here, and if not, why not."""
    if sys.platform != "linux":
        return False, "power-cut mounts need Linux (FUSE)"
    if os.geteuid() != 0:
        return False, "power-cut mounts need root (FUSE mounts with kernel caches turned off)"
    if not os.path.exists("/dev/fuse"):
        return False, "power-cut mounts need /dev/fuse"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return False, f"power-cut mounts need /dev/fuse to open: {exc}"
    if importlib.util.find_spec("mfusepy") is None:
        return False, "power-cut mounts need the mfusepy package (pip install 'chronomq[test]')"
    from ctypes.util import find_library

    if find_library("fuse3") is None:
        return False, "power-cut mounts need libfuse 3 (Debian: apt-get install fuse3)"
    return True, ""


def is_mounted(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a mount point, also when its FUSE process is dead (``stat`` then
    fails with ENOTCONN and ``os.path.ismount`` says False)."""
    target = os.path.abspath(path)
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 1 and _unescape(fields[1]) == target:
                    return True
    except OSError:
        return os.path.ismount(target)
    return False


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def _unmount(path: Path) -> None:
    for cmd in (["fusermount3", "-u", str(path)], ["umount", str(path)]):
        if shutil.which(cmd[0]) is None:
            continue
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return
    # Busy (a process still inside it): detach it now, it goes when the last user leaves.
    for cmd in (["fusermount3", "-u", "-z", str(path)], ["umount", "-l", str(path)]):
        if shutil.which(cmd[0]) is not None:
            subprocess.run(cmd, capture_output=True)
            if not is_mounted(path):
                return


class PowerCutError(RuntimeError):
    pass


class PowerCutMount:
    """A power-cut filesystem on ``mountpoint``, its files kept in ``state_dir/tree``."""

    def __init__(
        self,
        mountpoint: str | os.PathLike[str],
        state_dir: str | os.PathLike[str],
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.mountpoint = Path(mountpoint).absolute()
        self.state_dir = Path(state_dir).absolute()
        self.log_path = Path(log_path) if log_path is not None else self.state_dir / "fs.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock_dir: str | None = None
        self._log: IO[bytes] | None = None

    @property
    def control(self) -> Path:
        assert self._sock_dir is not None
        return Path(self._sock_dir) / "control.sock"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> PowerCutMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # A short private path: unix socket names are limited to 108 bytes.
        self._sock_dir = tempfile.mkdtemp(prefix="powercut-")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chronomq.ops.drill.powercut",
                str(self.mountpoint),
                "--state",
                str(self.state_dir),
                "--control",
                str(self.control),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    raise PowerCutError(
                        f"power-cut filesystem exited with {self._proc.returncode}; "
                        f"see {self.log_path}"
                    )
                if os.path.ismount(self.mountpoint) and self.control.exists():
                    with contextlib.suppress(OSError):
                        self.request("ping", timeout_s=2)
                        return self
                if time.monotonic() > deadline:
                    raise PowerCutError(f"{self.mountpoint} not mounted within {timeout_s} s")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def request(self, op: str, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(self.control))
            s.sendall(json.dumps({"op": op}).encode() + b"\n")
            with s.makefile("rb") as f:
                line = f.readline()
        if not line:
            raise PowerCutError(f"power-cut filesystem closed the control socket on {op!r}")
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise PowerCutError(f"{op}: {answer.get('error')}")
        return answer

    def cut(self) -> dict[str, Any]:
        """Lose power: every unsynced change is undone. Returns what was undone."""
        report: dict[str, Any] = self.request("cut")["report"]
        return report

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.request("status")["status"]
        return status

    def sync(self) -> None:
        self.request("sync")

    def kill_now(self) -> None:
        """Detach the mount (lazily: a process may still be inside) and kill the filesystem
        process, without waiting; for a drill that must exit at once."""
        for cmd in (
            ["fusermount3", "-u", "-z", str(self.mountpoint)],
            ["umount", "-l", str(self.mountpoint)],
        ):
            if shutil.which(cmd[0]) is not None:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    if subprocess.run(cmd, capture_output=True, timeout=2).returncode == 0:
                        break
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Unmount and end the filesystem process; idempotent, never leaves a mount behind."""
        if is_mounted(self.mountpoint):
            _unmount(self.mountpoint)
        p = self._proc
        if p is not None:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
                p.wait(timeout=10)
            self._proc = None
        if is_mounted(self.mountpoint):
            _unmount(self.mountpoint)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None

    def __enter__(self) -> PowerCutMount:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
