"""Typed errors raised by the engine.

Every error the engine raises on bad input derives from `EngineError`, so a caller (a
region agent, the CLI) maps one family to one status. Messages are stable, human-readable
and name the offending value.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on bad input or bad state."""


class UnknownModel(EngineError):
    """The name is neither a catalog model nor an existing model directory."""


class ModelNotPrepared(EngineError):
    """A catalog model that has not been prepared into the model cache yet."""


class ModelPrepareError(EngineError):
    """Preparing a model failed (missing source package, bad source file)."""


class InvalidPrompt(EngineError):
    """The prompt is empty or holds token ids outside the model's vocabulary."""


class PromptTooLong(InvalidPrompt):
    """The prompt (plus the tokens to generate) does not fit the model's context."""


class InvalidSamplingParams(EngineError):
    """Sampling parameters out of range (negative temperature, top_p outside (0, 1])."""


class KVFormatError(EngineError):
    """Serialized KV bytes that cannot be parsed: bad magic, unknown version, bad header."""


class KVTruncated(KVFormatError):
    """Serialized KV bytes that end before the length their header announces."""


class KVChecksumMismatch(KVFormatError):
    """Serialized KV bytes whose payload does not match the checksum in their header."""


class KVIncompatible(EngineError):
    """A well-formed KV cache that this engine cannot decode from."""


class ModelMismatch(KVIncompatible):
    """The KV cache was produced by a different model (config or weights)."""


class KVDtypeMismatch(KVIncompatible):
    """The KV cache's dtype differs from the dtype the decoding engine runs in."""


class KVShapeMismatch(KVIncompatible):
    """The KV cache's layer count or head layout differs from the model's."""


class WorkerTimeout(EngineError):
    """An engine worker process did not answer within its deadline."""


class EngineUnavailable(EngineError):
    """The engine's server process (a vLLM server) is not running or cannot be reached."""
