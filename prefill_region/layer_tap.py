"""Layer-wise KV out of an HF model: a forward hook on every decoder layer hands that
layer's K/V to a callback as soon as the layer has run, while later layers still compute.

Hooks are installed once per model; a thread opts in with `tapping(on_layer)` around its
own `engine.prefill(...)` (module forwards run in the calling thread), so concurrent
prefills, decodes and the local path share one model without seeing each other's layers.
The tensors handed out are the cache's own (no copy): the prefill result's KV holds the
same memory, and nothing writes to it after its layer has run.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

OnLayer = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, k, v); k, v: [kv_heads, tokens, head_dim]


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a causal LM (Llama-family layout: model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: layer-wise shipment needs a decoder stack")
    return list(layers)


class LayerTap:
    def __init__(self, model: Any) -> None:
        self._local = threading.local()
        self.num_layers = 0
        for index, layer in enumerate(decoder_layers(model)):
            layer.register_forward_hook(functools.partial(self._hook, index), with_kwargs=True)
            self.num_layers += 1

    def _hook(self, index: int, _module: Any, _args: Any, kwargs: dict[str, Any], _output: Any) -> None:
        on_layer: OnLayer | None = getattr(self._local, "on_layer", None)
        if on_layer is None:
            return
        cache = kwargs.get("past_key_values")
        if cache is None:
            raise RuntimeError("layer-wise tap needs the forward to run with a KV cache (use_cache=True)")
        layer = cache.layers[index]
        # cache tensors: [1, kv_heads, tokens, head_dim]; the batch dim goes (batch size is one).
        on_layer(index, layer.keys[0].contiguous(), layer.values[0].contiguous())

    @contextmanager
    def tapping(self, on_layer: OnLayer) -> Iterator[None]:
        """Within the block, this thread's forwards call `on_layer` after each decoder layer.
        An exception raised by `on_layer` aborts the forward (cancel, deadline)."""
        if getattr(self._local, "on_layer", None) is not None:
            raise RuntimeError("this thread is already tapping a forward")
        self._local.on_layer = on_layer
        try:
            yield
        finally:
            self._local.on_layer = None


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (keeps the tensor alive)."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)
