"""Several token streams read as one: a batch of prompts streams its choices interleaved, as
they come (vLLM's order), each stream read on a thread of its own."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


def merged(streams: list[Iterator[T]]) -> Iterator[tuple[int, T]]:
    """(index of its stream, item) as items come. The first exception a stream raises is raised
    here. Closing this generator stops taking items; a stream mid-read ends on its own (each has
    its deadline; the caller cancels their jobs), and its thread then exits."""
    items: queue.Queue[tuple[int, object]] = queue.Queue()
    stop = threading.Event()

    def pump(index: int, stream: Iterator[T]) -> None:
        try:
            for item in stream:
                items.put((index, item))
                if stop.is_set():
                    break
        except BaseException as exc:  # handed to the reader, raised there
            items.put((index, exc))
        finally:
            items.put((index, _END))
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    threads = [
        threading.Thread(target=pump, args=(i, s), name=f"prfaas-merge-{i}", daemon=True) for i, s in enumerate(streams)
    ]
    for thread in threads:
        thread.start()
    open_streams = len(streams)
    try:
        while open_streams:
            index, item = items.get()
            if item is _END:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        stop.set()
