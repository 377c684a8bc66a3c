import json
import os
from pathlib import Path

import pytest

from prfaas.engine.errors import ModelNotPrepared, UnknownModel
from prfaas.engine.models import MANIFEST, list_models, model_fingerprint, prepare_model, resolve_model


def test_tiny_build_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    first = prepare_model("tiny-llama", tmp_path / "a")
    assert not first.reused
    again = prepare_model("tiny-llama", tmp_path / "a")
    assert again.reused
    assert again.checksum == first.checksum
    elsewhere = prepare_model("tiny-llama", tmp_path / "b")  # a fresh build, same bytes
    assert elsewhere.checksum == first.checksum
    manifest = json.loads((first.path / MANIFEST).read_text())
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_damaged_model_is_rebuilt(tmp_path: Path) -> None:
    prepared = prepare_model("tiny-llama", tmp_path)
    weights = prepared.path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    rebuilt = prepare_model("tiny-llama", tmp_path)
    assert not rebuilt.reused
    assert rebuilt.checksum == prepared.checksum


def test_unknown_model_names_the_catalog(tmp_path: Path) -> None:
    with pytest.raises(UnknownModel, match="unknown model 'gpt-5'; available: smollm2-135m, tiny-llama"):
        prepare_model("gpt-5", tmp_path)


def test_unprepared_catalog_model_says_how_to_prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRFAAS_HOME", str(tmp_path))
    with pytest.raises(ModelNotPrepared, match="run `prfaas model prepare tiny-llama`"):
        resolve_model("tiny-llama")
    assert [m.prepared for m in list_models()] == [False, False]


def test_any_hf_folder_resolves_by_path(tmp_path: Path) -> None:
    prepared = prepare_model("tiny-llama", tmp_path)
    assert resolve_model(str(prepared.path)) == prepared.path
    with pytest.raises(UnknownModel, match="neither a catalog model"):
        resolve_model(str(tmp_path / "nowhere"))


def test_fingerprint_ignores_volatile_config_keys(tmp_path: Path) -> None:
    path = prepare_model("tiny-llama", tmp_path).path
    before = model_fingerprint(path)
    config = json.loads((path / "config.json").read_text())
    config["transformers_version"] = "0.0.0"
    (path / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(path) == before
    config["rms_norm_eps"] = 1e-3
    (path / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(path) != before


@pytest.mark.skipif(os.environ.get("PRFAAS_SKIP_SMOLLM2") == "1", reason="SmolLM2 disabled for this run")
def test_smollm2_is_prepared_from_the_pypi_package() -> None:
    prepared = prepare_model("smollm2-135m")  # reuses the copy `make models` built
    config = json.loads((prepared.path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config  # a plain HF Llama, loadable anywhere
