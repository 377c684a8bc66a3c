"""The query energy the kv codecs shape key scales by (prfaas.engine.calibration): measured from the
model's real post-RoPE queries, stored by fingerprint, refused when it does not fit, and the model
left as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from prfaas.engine.calibration import (
    CalibrationFile,
    calibrate,
    calibration_path,
    calibration_windows,
    load_query_energy,
    measure_query_energy,
    save_query_energy,
)
from prfaas.engine.hf import HFEngine


@torch.inference_mode()
def first_layer_energy(engine: HFEngine, windows: list[list[int]]) -> torch.Tensor:
    """E[q^2] of layer 0 by hand: embeddings, input norm, q_proj, RoPE; averaged over each kv head's group."""
    model = engine.model
    attention = model.model.layers[0].self_attn
    total, count = 0.0, 0
    for window in windows:
        ids = torch.tensor([window])
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        q = attention.q_proj(hidden).view(1, len(window), -1, engine.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(hidden, torch.arange(len(window)).unsqueeze(0))
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        total = total + q.pow(2).sum(dim=(0, 2))
        count += len(window)
    per_query_head = total / count  # [query heads, head_dim]
    return per_query_head.view(engine.num_kv_heads, -1, engine.head_dim).mean(dim=1)


def test_the_query_energy_is_the_mean_square_of_the_real_queries(tiny_engine: HFEngine) -> None:
    windows = [w[:64] for w in calibration_windows(tiny_engine.tokenizer)[:3]]
    probe = torch.tensor([windows[0]])
    before = tiny_engine.model(input_ids=probe).logits
    energy = measure_query_energy(tiny_engine.model, windows)
    assert energy.shape == (tiny_engine.num_layers, tiny_engine.num_kv_heads, tiny_engine.head_dim)
    assert energy.dtype == np.float32 and np.isfinite(energy).all() and (energy > 0).all()
    np.testing.assert_allclose(energy[0], first_layer_energy(tiny_engine, windows).numpy(), rtol=1e-4)
    # the model's attention is back as it was: the same logits bit for bit
    assert tiny_engine.model.config._attn_implementation == "sdpa"
    assert torch.equal(tiny_engine.model(input_ids=probe).logits, before)


def test_stored_energy_is_found_by_fingerprint_and_refused_when_it_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRFAAS_HOME", str(tmp_path))
    energy = np.arange(1, 2 * 3 * 4 + 1, dtype=np.float32).reshape(2, 3, 4)
    path = save_query_energy("abc", energy)
    assert path == calibration_path("abc") and path.is_relative_to(tmp_path)
    np.testing.assert_array_equal(load_query_energy("abc", 2, 3, 4), energy)
    assert load_query_energy("other", 2, 3, 4) is None  # another model
    assert load_query_energy("abc", 2, 3, 5) is None  # another shape
    bad = energy.copy()
    bad[1] = 0.0  # a layer without energy
    save_query_energy("abc", bad)
    assert load_query_energy("abc", 2, 3, 4) is None
    path.write_bytes(b"not an npz")
    assert load_query_energy("abc", 2, 3, 4) is None
    assert not list(tmp_path.glob("calibration/.calibration-*"))  # no scratch left behind


def test_a_calibration_handed_by_path_is_checked_against_the_layers_it_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What a vLLM region hands its server's connector: read once, at the first shipment's shapes."""
    monkeypatch.setenv("PRFAAS_HOME", str(tmp_path))
    energy = np.arange(1, 2 * 3 * 4 + 1, dtype=np.float32).reshape(2, 3, 4)
    path = save_query_energy("abc", energy)
    layers = [(3, 100, 4), (3, 100, 4)]
    np.testing.assert_array_equal(CalibrationFile(path, "abc").for_layers(layers), energy)
    assert CalibrationFile(path, "abc").for_layers([(3, 100, 4)] * 3) is None  # another model's layers
    assert CalibrationFile(path, "other").for_layers(layers) is None  # another model's file
    assert CalibrationFile(tmp_path / "missing.npz", "abc").for_layers(layers) is None
    assert "kvw6 and kvw4 quantize keys by range" in caplog.text
    once = CalibrationFile(path, "abc")
    assert once.for_layers(layers) is not None
    path.unlink()
    assert once.for_layers(layers) is not None  # read once: a shipment never waits on the disk again


def test_calibrate_measures_once_and_an_engine_loads_it(
    tiny_engine: HFEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRFAAS_HOME", str(tmp_path))
    path, measured = calibrate(tiny_engine.path)
    assert measured and path.exists()
    assert calibrate(tiny_engine.path) == (path, False)
    engine = HFEngine(tiny_engine.path)
    assert engine.query_energy is not None and engine.query_energy.shape == (
        engine.num_layers, engine.num_kv_heads, engine.head_dim,
    )  # fmt: skip


def damaged_copies(good: bytes) -> dict[str, bytes]:
    """What a cache can hold after a full disk or an interrupted copy."""
    return {
        "cut short": good[: len(good) // 2],  # zipfile.BadZipFile
        "empty": b"",  # EOFError
        "one payload byte flipped": good[:200] + bytes([good[200] ^ 0xFF]) + good[201:],  # bad CRC-32
    }


def test_a_damaged_calibration_is_ignored_with_a_warning_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PRFAAS_HOME", str(tmp_path))
    path = save_query_energy("abc", np.ones((2, 3, 4), dtype=np.float32))
    good = path.read_bytes()
    for label, data in damaged_copies(good).items():
        path.write_bytes(data)
        caplog.clear()
        assert load_query_energy("abc", 2, 3, 4) is None, label
        assert str(path) in caplog.text, label
        handed = CalibrationFile(path, "abc")
        assert handed.for_layers([(3, 100, 4)] * 2) is None, label
        path.write_bytes(good)
        assert handed.for_layers([(3, 100, 4)] * 2) is None, label  # read once: one warning, not one per shipment


def test_an_engine_starts_over_a_damaged_calibration_and_calibrate_replaces_it(
    tiny_engine: HFEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRFAAS_HOME", str(tmp_path))
    path = save_query_energy(tiny_engine.fingerprint, np.ones((2, 3, 4), dtype=np.float32))  # another shape
    assert calibrate(tiny_engine.path) == (path, True)  # a file that does not fit the model is measured again
    path.write_bytes(path.read_bytes()[:100])  # cut short
    assert HFEngine(tiny_engine.path).query_energy is None  # uncalibrated, not failing to start
    assert calibrate(tiny_engine.path) == (path, True)
    assert HFEngine(tiny_engine.path).query_energy is not None
    assert not list(tmp_path.glob("calibration/.calibration-*"))  # written through a scratch file
