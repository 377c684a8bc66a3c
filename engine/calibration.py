"""A model's query energy per key channel: what the kv codecs' query-weighted key scales need.

A key channel's quantization error moves attention logits by q . dk / sqrt(head_dim): a channel
the queries barely read can take a coarse step, one they weigh needs a fine one. The energy
E[q_c^2] of every (layer, kv head, channel), over the post-RoPE queries that read it (the query
heads of its group, averaged), measured once per model on a fixed calibration text: 10 windows of
512 tokens of standard-library sources not among the codec bench's prompts (bench/codec_quality.py).

Stored as `$PRFAAS_HOME/calibration/<model fingerprint>.npz` (`query_energy`: float32
[num_layers, num_kv_heads, head_dim]); `prfaas model calibrate` writes it, `make models` runs that,
and an engine loads it by its model's fingerprint (`load_query_energy`; None when absent: the
codecs then scale keys by their range alone). Only the prefill side uses it: the payload it shapes
decodes without it.

Measuring switches the model to a recording copy of SDPA attention for one forward pass: run it
on a model that serves nothing else (the CLI loads its own).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prfaas.engine.models import model_fingerprint, prfaas_home

CALIBRATION_MODULES = ("ast", "pickle", "threading", "tokenize", "random")  # two windows each
WINDOW_TOKENS = 512
_RECORDER = "prfaas_query_energy"
log = logging.getLogger(__name__)


def calibration_windows(tokenizer: Any) -> list[list[int]]:
    """Token windows of the calibration text: WINDOW_TOKENS each, at a quarter and a half of each module."""
    windows = []
    for name in CALIBRATION_MODULES:
        ids = tokenizer.encode(inspect.getsource(importlib.import_module(name)), add_special_tokens=False)
        for start in (len(ids) // 4, len(ids) // 2):
            windows.append(ids[start : start + WINDOW_TOKENS])
    return windows


@torch.inference_mode()
def measure_query_energy(model: Any, windows: list[list[int]]) -> np.ndarray:
    """E[q_c^2] [num_layers, num_kv_heads, head_dim] of `model`'s post-RoPE queries over `windows`,
    averaged over each kv head's query heads."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = model.config
    layers = int(config.num_hidden_layers)
    sums: dict[int, torch.Tensor] = {}
    count = [0]

    def recording(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        energy = query.float().pow(2).sum(dim=(0, 2))  # [query heads, head_dim]
        index = int(module.layer_idx)
        sums[index] = sums[index] + energy if index in sums else energy
        if index == 0:
            count[0] += query.shape[0] * query.shape[2]
        return sdpa_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register(_RECORDER, recording)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_RECORDER, sdpa_mask)
    previous = config._attn_implementation
    model.set_attn_implementation(_RECORDER)
    try:
        device = next(model.parameters()).device
        for window in windows:
            model(input_ids=torch.tensor([window], device=device), use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    if len(sums) != layers or not count[0]:
        raise RuntimeError(f"recorded queries of {len(sums)} of {layers} layers: not a decoder using SDPA?")
    kv_heads = int(config.num_key_value_heads)
    per_layer = [(sums[i] / count[0]).view(kv_heads, -1, sums[i].shape[-1]).mean(dim=1) for i in range(layers)]
    return torch.stack(per_layer).cpu().numpy().astype(np.float32)


def calibration_path(fingerprint: str) -> Path:
    return prfaas_home() / "calibration" / f"{fingerprint}.npz"


def save_query_energy(fingerprint: str, energy: np.ndarray) -> Path:
    """Write atomically (a temporary file renamed into place); the path written."""
    path = calibration_path(fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=".calibration-", suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, query_energy=energy, fingerprint=np.array(fingerprint))
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    return path


def load_query_energy(fingerprint: str, num_layers: int, num_kv_heads: int, head_dim: int) -> np.ndarray | None:
    """The stored query energy of the model `fingerprint`, or None when there is none, or one that is not
    a finite, non-negative array of [num_layers, num_kv_heads, head_dim] for that fingerprint."""
    return read_query_energy(calibration_path(fingerprint), fingerprint, (num_layers, num_kv_heads, head_dim))


def read_query_energy(path: Path, fingerprint: str, shape: tuple[int, int, int]) -> np.ndarray | None:
    """The query energy stored at `path` (a vLLM worker is handed the path by its region), or None unless
    it is that model's, of `shape` [num_layers, num_kv_heads, head_dim], finite, non-negative and not all
    zero in any layer."""
    try:
        with np.load(path) as stored:
            energy = np.asarray(stored["query_energy"], dtype=np.float32)
            owner = str(stored["fingerprint"])
    except FileNotFoundError:
        return None  # not calibrated: the usual case, nothing to say
    # Any failure: a damaged file raises what its first bad byte triggers (BadZipFile for a cut copy, EOFError
    # for an empty one, zlib.error, ValueError from a bad .npy header ...) and the file is only an optimization,
    # so no error of it may stop an engine from starting; `calibrate` measures it again.
    except Exception as e:
        log.warning("calibration %s is unreadable (%s: %s): ignored", path, type(e).__name__, e)
        return None
    if owner != fingerprint or energy.shape != shape:
        return None
    if not np.isfinite(energy).all() or (energy < 0).any() or not bool((energy > 0).any(axis=(1, 2)).all()):
        return None
    return energy


class CalibrationFile:
    """A model's calibration handed over by path (a vLLM region to its server's connector), read at the first
    shipment, when the layers' shapes are known: `for_layers` is its query energy, or None when the file is
    missing, not the model `fingerprint`'s or does not fit the layers (logged once: keys then go by range,
    kv6's and kv4's steps). Thread-safe enough: a race reads the file twice, to the same result."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path, self.fingerprint = path, fingerprint
        self._read = False
        self._energy: np.ndarray | None = None

    def for_layers(self, shapes: Sequence[tuple[int, int, int]]) -> np.ndarray | None:
        """`shapes`: each layer's [num_kv_heads, num_tokens, head_dim]."""
        if not self._read:
            heads, head_dim = shapes[0][0], shapes[0][2]
            try:
                self._energy = read_query_energy(self.path, self.fingerprint, (len(shapes), heads, head_dim))
            finally:  # whatever the file holds, it costs one warning, never an error per shipment
                self._read = True
            if self._energy is None:
                log.warning("calibration %s does not fit this model: kvw6 and kvw4 quantize keys by range", self.path)
        return self._energy


def calibrate(folder: Path, *, force: bool = False) -> tuple[Path, bool]:
    """Measure and store the query energy of the model in `folder` unless stored already (and reading back
    as that model's: a damaged or foreign file is measured again and replaced); (path, measured now)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    fingerprint = model_fingerprint(folder)
    path = calibration_path(fingerprint)
    if path.exists() and not force:
        config: Any = AutoConfig.from_pretrained(folder, local_files_only=True)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        shape = (int(config.num_hidden_layers), int(config.num_key_value_heads), head_dim)
        if read_query_energy(path, fingerprint, shape) is not None:
            return path, False
        log.warning("calibration %s does not read back as %s's: measuring it again", path, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    energy = measure_query_energy(model, calibration_windows(tokenizer))
    if not math.isfinite(float(energy.sum())):
        raise RuntimeError(f"query energy of {folder} is not finite")
    return save_query_energy(fingerprint, energy), True
