"""GPU and model profiles, and the roofline timings derived from them.

Peak figures are the vendors' datasheets (docs/simulator.md, "Sources"); the efficiency
factors (`prefill_mfu`, `hbm_efficiency`) are the assumptions that turn a peak into a served
rate. Prefill is compute-bound, decode memory-bandwidth-bound: a worker of `num_gpus` GPUs
(tensor parallel) prefills at FLOPs / (peak * mfu) and decodes one batch step in
max(bytes read / (HBM bandwidth * efficiency), FLOPs / (peak * mfu)) plus a fixed overhead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GpuProfile:
    name: str
    bf16_tflops: float  # dense (no sparsity) BF16 tensor peak, TFLOP/s
    hbm_tb_per_s: float  # HBM bandwidth, TB/s
    hbm_gb: float  # HBM capacity, GB
    usd_per_gpu_hour: float  # default on-demand price (a scenario may override it)
    spot_usd_per_gpu_hour: float | None = None


GPUS: dict[str, GpuProfile] = {
    g.name: g
    for g in (
        GpuProfile("H200", 989.0, 4.8, 141.0, 3.80, 2.10),
        GpuProfile("H100", 989.0, 3.35, 80.0, 2.99, 1.60),
        GpuProfile("H20", 148.0, 4.0, 96.0, 1.20, 0.70),
        GpuProfile("A100", 312.0, 2.039, 80.0, 1.79, 0.90),
        GpuProfile("L40S", 362.0, 0.864, 48.0, 0.99, 0.55),
        GpuProfile("MI300X", 1307.0, 5.3, 192.0, 2.50, 1.40),
        # The development host's CPU, for calibration runs: its timings are measured
        # (`sim.calibration`), so these peaks are never used.
        GpuProfile("host-cpu", 1.0, 0.05, 64.0, 0.0),
    )
}


@dataclass(frozen=True)
class ModelProfile:
    name: str
    total_params: float  # parameters held in HBM
    active_params: float  # parameters touched per token (MoE: the routed experts)
    num_layers: int
    kv_bytes_per_token: int  # K and V of one token over all layers, bytes
    attn_flops_per_token_ctx: float  # attention FLOPs per token per context token (full-attention layers)
    weight_bytes_per_param: float = 2.0  # bf16: 2, fp8: 1, int4: 0.5
    kv_state_bytes: int = 0  # per request, whatever its length: linear-attention recurrent states


MODELS: dict[str, ModelProfile] = {
    m.name: m
    for m in (
        # Llama-3-8B shape: 32 layers, 8 KV heads x 128 dims, bf16: 2 * 32 * 8 * 128 * 2 = 131,072 B/token.
        ModelProfile("dense-8b", 8.0e9, 8.0e9, 32, 131_072, 4 * 32 * 4096),
        # Llama-3-70B: 80 layers, 8 KV heads x 128 dims, bf16: 327,680 B/token.
        ModelProfile("dense-70b", 70.6e9, 70.6e9, 80, 327_680, 4 * 80 * 8192),
        # DeepSeek-V3 MLA: 61 layers x (512 latent + 64 rope) x 2 bytes = 70,272 B/token; fp8 weights.
        ModelProfile("deepseek-v3", 671e9, 37e9, 61, 70_272, 4 * 61 * 128 * 192, 1.0),
        # A 1T-class hybrid-attention MoE (linear attention in 3 of 4 layers), KV ~10x below MLA.
        ModelProfile("hybrid-1t", 1.04e12, 32e9, 61, 7_027, 4 * 15 * 128 * 192, 1.0),
        # PrfaaS's internal 1T hybrid (Kimi Linear layout, KDA:MLA 3:1), its KVCache sizes as
        # published (arXiv 2604.15039, Table 5: 190.8 / 308.9 / 701.3 / 2316.3 MiB at 1K / 8K /
        # 32K / 128K tokens), least squares: 172.0 MiB of recurrent state + 17,143 B/token.
        # Served on 8 GPUs per instance on H20 too (8 x 96 GB), so the weights are int4.
        ModelProfile("prfaas-1t", 1.04e12, 32e9, 61, 17_143, 4 * 15 * 128 * 192, 0.5, 180_355_072),
    )
}

PREFILL_MFU = 0.45  # share of peak FLOPs a chunked prefill sustains
DECODE_MFU = 0.30
HBM_EFFICIENCY = 0.70  # share of peak HBM bandwidth a decode step sustains
DECODE_STEP_OVERHEAD_S = 0.004  # kernel launches, sampling, scheduling per step
KV_HEADROOM = 0.90  # share of HBM left after weights that holds KV


class WorkerTimings(Protocol):
    """What the simulator asks of a worker: the roofline `WorkerModel`, or timings measured on a
    real deployment (`sim.calibration.MeasuredWorker`)."""

    @property
    def kv_capacity_bytes(self) -> int: ...

    def prefill_s(self, num_tokens: int, cached_tokens: int = 0) -> float: ...

    def prefill_tokens_per_s(self, num_tokens: int = 8192) -> float: ...

    def decode_step_s(self, batch: int, context_tokens: int) -> float: ...

    @property
    def max_batch(self) -> int | None:
        """Most sequences one worker decodes at once (None: bounded only by KV capacity)."""
        ...


@dataclass(frozen=True)
class WorkerModel:
    """One model replica of `num_gpus` GPUs of one kind serving one model."""

    gpu: GpuProfile
    model: ModelProfile
    num_gpus: int

    def __post_init__(self) -> None:
        if self.kv_capacity_bytes <= 0:
            raise ValueError(
                f"{self.model.name} weights do not fit on {self.num_gpus} x {self.gpu.name} "
                f"({self.num_gpus * self.gpu.hbm_gb:.0f} GB)"
            )

    @property
    def kv_capacity_bytes(self) -> int:
        weights = self.model.total_params * self.model.weight_bytes_per_param
        return int((self.num_gpus * self.gpu.hbm_gb * 1e9 - weights) * KV_HEADROOM)

    @property
    def max_batch(self) -> int | None:
        return None

    def prefill_s(self, num_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill `num_tokens` new tokens after `cached_tokens` already in the cache."""
        m = self.model
        ctx = cached_tokens + num_tokens / 2.0  # mean context a new token attends to
        flops = num_tokens * (2.0 * m.active_params + m.attn_flops_per_token_ctx * ctx)
        return flops / (self.num_gpus * self.gpu.bf16_tflops * 1e12 * PREFILL_MFU)

    def prefill_tokens_per_s(self, num_tokens: int = 8192) -> float:
        return num_tokens / self.prefill_s(num_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode iteration for `batch` sequences holding `context_tokens` in all."""
        m = self.model
        touched = min(m.total_params, m.active_params * max(batch, 1))  # MoE: more experts as the batch grows
        read = touched * m.weight_bytes_per_param + context_tokens * m.kv_bytes_per_token
        memory_s = read / (self.num_gpus * self.gpu.hbm_tb_per_s * 1e12 * HBM_EFFICIENCY)
        flops = batch * 2.0 * m.active_params + m.attn_flops_per_token_ctx * context_tokens
        compute_s = flops / (self.num_gpus * self.gpu.bf16_tflops * 1e12 * DECODE_MFU)
        return DECODE_STEP_OVERHEAD_S + max(memory_s, compute_s)
