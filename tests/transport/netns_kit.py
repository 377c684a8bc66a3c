"""A network namespace of the test's own, entered by the calling thread only.

aiortc skips 127.0.0.1 when it gathers ICE host candidates, so WebRTC tests run where the
loopback interface also has 127.0.0.2: a namespace they create (root needed) and enter
with setns(2) on the current thread. Threads started inside inherit it (the aiortc loop
threads); the rest of the test process stays in the root namespace. `call_in` builds an
object inside an existing namespace (one end of `devstack.wanlink`'s link) the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

CLONE_NEWNET = 0x40000000
T = TypeVar("T")
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


def call_in(name: str, make: Callable[[], T]) -> T:
    """`make()` on a thread of its own entered into namespace `name` (/run/netns/NAME): the
    sockets it opens and the threads it starts (a channel's streams, a receiver's acceptor)
    live in that namespace, while the caller stays where it is."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        target = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(target)  # this thread only, and it ends here
            result.append(make())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)
        finally:
            os.close(target)

    thread = threading.Thread(target=run, name=f"netns-{name}")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
