"""Where a benchmark's nodes keep their files, and what is left of it afterwards.

With ``--data-dir`` the directory is the operator's and stays. Otherwise a new temporary one
is made: removed after a run that went well (a million-message burst leaves gigabytes), kept
after a failure, with its path printed, for the node logs in it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def add_data_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        help="where the nodes keep their files, kept afterwards (default: a temporary "
        "directory, removed after a good run and kept after a failure)",
    )


class BenchDir:
    def __init__(self, path: Path, temporary: bool) -> None:
        self.path = path
        self.temporary = temporary
        self.kept = not temporary

    def keep(self) -> None:
        """Keep a temporary directory (the run found something worth reading the logs for)."""
        self.kept = True


@contextmanager
def bench_dir(args: argparse.Namespace, prefix: str) -> Iterator[BenchDir]:
    """Sets ``args.data_dir`` for the run; see the module docstring."""
    if args.data_dir:
        yield BenchDir(Path(args.data_dir), temporary=False)
        return
    d = BenchDir(Path(tempfile.mkdtemp(prefix=prefix)), temporary=True)
    args.data_dir = str(d.path)
    try:
        yield d
    except BaseException:
        d.keep()
        raise
    finally:
        if d.kept and d.temporary:
            print(f"node files and logs kept in {d.path}", file=sys.stderr)
        elif d.temporary:
            shutil.rmtree(d.path, ignore_errors=True)
