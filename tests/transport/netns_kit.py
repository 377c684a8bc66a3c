"""A network namespace of the test's own, entered by the calling thread only.

aiortc skips 127.0.0.1 when it gathers ICE host candidates, so WebRTC tests run where the
loopback interface also has 127.0.0.2: a namespace they create (root needed) and enter
with setns(2) on the current thread. Threads started inside inherit it (the aiortc loop
threads); the rest of the test process stays in the root namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
ALT_LOOPBACK = "127.0.0.2"


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def can_create() -> bool:
    return os.geteuid() == 0 and subprocess.run(["ip", "-V"], capture_output=True).returncode == 0


@contextlib.contextmanager
def netns(name: str) -> Iterator[str]:
    """Create namespace `name` (lo up, plus 127.0.0.2), enter it on this thread; undo both."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", f"{ALT_LOOPBACK}/8", "dev", "lo"], check=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield name
            finally:
                _setns(home)
        finally:
            os.close(target)
            os.close(home)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
