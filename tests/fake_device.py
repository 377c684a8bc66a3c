"""A fake CUDA device for the GPU-specific paths of engine/staging.py: `DeviceOps` whose copies land
`delay_s` after they are enqueued and after the event they wait on fired, one at a time and in order, on a
copy thread of their own (what a side CUDA stream does); `layer_done` events fire at once (the fake compute
is synchronous) unless `compute_s` is set: then each fires that long after it was recorded (compute still
queued on the stream). Tensors on both ends are CPU tensors: a copy moves their bytes as a DMA would."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from prfaas.engine.staging import as_bytes


class FakeDevice:
    def __init__(self, delay_s: float = 0.002, compute_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.compute_s = compute_s
        self.tasks: queue.Queue[tuple[list[tuple[torch.Tensor, torch.Tensor]], Any, threading.Event]] = queue.Queue()
        self.copies = 0
        threading.Thread(target=self._engine, daemon=True).start()

    def _engine(self) -> None:
        while True:
            pairs, after, done = self.tasks.get()
            if after is not None:
                after.wait()
            time.sleep(self.delay_s)
            for destination, source in pairs:
                as_bytes(destination).copy_(as_bytes(source))
            self.copies += 1
            done.set()

    def side_stream(self) -> Any:
        return "side"

    def layer_done(self) -> Any:
        event = threading.Event()
        if self.compute_s:
            threading.Timer(self.compute_s, event.set).start()
        else:
            event.set()
        return event

    def copy_after(self, stream: Any, event: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        assert stream == "side"
        done = threading.Event()
        self.tasks.put((pairs, event, done))
        return done

    def wait(self, event: Any, timeout_s: float) -> bool:
        return bool(event.wait(timeout_s))
