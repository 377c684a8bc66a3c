"""The `prfaas` command. Thin: parses arguments, calls package entry points, prints."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from prfaas.cli.bench import bench as bench_command
from prfaas.cli.model import model_app, prepare_for_up, quiet_transformers
from prfaas.cli.sim import sim_app
from prfaas.cli.tour import tour as tour_command
from prfaas.cli.trace import trace as trace_command
from prfaas.engine.errors import EngineError

app = typer.Typer(
    help="prfaas: cross-region Prefill-as-a-Service.", no_args_is_help=True, pretty_exceptions_show_locals=False
)
app.add_typer(model_app, name="model")
sched_app = typer.Typer(help="The global scheduler: explain a placement.", no_args_is_help=True)
app.add_typer(sched_app, name="sched")
certs_app = typer.Typer(help="Certificates for mutual TLS between components.", no_args_is_help=True)
app.add_typer(certs_app, name="certs")
console = Console()


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Print one `error:` line, never wrapped at the terminal's width (a log's 80 columns split a path) ->
    the exit to raise."""
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@sched_app.command(
    "explain",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def sched_explain(ctx: typer.Context) -> None:
    """Decide one request on one snapshot and print the Decision (or rejection) as JSON:
    --snapshot FILE --request FILE [--config POLICY.yaml]; --help for all options.
    Exit 0 placed, 3 rejected, 2 bad input."""
    from prfaas.control_plane.scheduling.explain import main as explain_main

    raise typer.Exit(explain_main(ctx.args))


@certs_app.command("init")
def certs_init(
    directory: Path = typer.Option(None, "--dir", help="where to write them (default $PRFAAS_HOME/certs)"),
    names: list[str] = typer.Option(["node"], "--name", help="node certificates to issue (repeatable)"),
    sans: list[str] = typer.Option(
        ["localhost", "127.0.0.1"], "--san", help="DNS name or IP peers dial this node at (repeatable)"
    ),
    identity: str = typer.Option(
        None,
        help="the node's identity, e.g. prfaas://prefill/REGION/INSTANCE or prfaas://control-plane/NAME "
        "(one --name with it)",
    ),
    days: int = typer.Option(825, min=1, help="validity of node certificates"),
    force: bool = typer.Option(False, help="replace the CA too (every node needs new certificates then)"),
) -> None:
    """Create the deployment's CA (kept if present) and a certificate + key per node name.
    Every connection between components loads its node files and the CA: gRPC between the
    control plane and regions, and KV (transport/tls.py; identities: transport/identity.py)."""
    from prfaas.engine.models import prfaas_home
    from prfaas.transport.identity import Identity, IdentityError
    from prfaas.transport.tls import init_certs

    target = directory or prfaas_home() / "certs"
    existed = (target / "ca.pem").exists() and not force
    try:
        if identity is not None and len(names) != 1:
            raise ValueError("--identity names one node: give exactly one --name with it")
        identities = {names[0]: Identity.parse(identity)} if identity is not None else {}
        ca, nodes = init_certs(target, names, sans, identities=identities, days=days, force=force)
    except (ValueError, OSError, IdentityError) as exc:
        raise _fail(str(exc)) from None
    console.print(f"CA {'kept' if existed else 'created'}: {ca}")
    for node in nodes:
        console.print(f"issued {node.cert} (key {node.key}, 0600) for {', '.join(sans)}"
                      + (f" as {identity}" if identity else ""))  # fmt: skip


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", help="catalog name or HF model folder"),
    prompt: str | None = typer.Option(None, help="user message (default: a built-in question)"),
    max_new_tokens: int = typer.Option(48, min=1),
) -> None:
    """Generate split (prefill and decode in two processes) and colocated; compare."""
    from prfaas.devstack.demo import DEFAULT_PROMPT, run_demo

    quiet_transformers()
    try:
        report = run_demo(model, prompt or DEFAULT_PROMPT, max_new_tokens)
    except EngineError as exc:
        raise _fail(str(exc)) from None
    console.print(f"[bold]model[/bold] {report.model}, prompt {report.prompt_tokens} tokens, fp32 greedy")
    console.print(f"[bold]colocated[/bold] (one process):\n{report.colocated_text}\n")
    console.print(
        f"[bold]split[/bold] (prefill pid {report.prefill_pid} -> {report.kv_bytes:,} KV bytes -> "
        f"decode pid {report.decode_pid}):\n{report.split_text}\n"
    )
    table = Table("", "prefill s", "decode ms/token")
    table.add_row("colocated", f"{report.colocated_prefill_s:.3f}", f"{report.colocated_decode_ms_per_token:.1f}")
    table.add_row("split", f"{report.split_prefill_s:.3f}", f"{report.split_decode_ms_per_token:.1f}")
    console.print(table)
    console.print(f"KV bytes/token: {report.kv_bytes_per_token:,}")
    if report.identical:
        console.print("[green]split output is identical to colocated[/green]")
    else:
        console.print("[red]split output DIFFERS from colocated[/red]")
        raise typer.Exit(1)


@app.command()
def region(
    config: Path = typer.Option(..., "--config", help="the region's YAML file (docs/regions.md)"),
    log_level: str = typer.Option("INFO", help="logging level"),
) -> None:
    """Start one region (prefill, decode or both) from its config; SIGTERM drains it."""
    import logging

    from prfaas.region.config import ConfigError, load_config

    if not isinstance(logging.getLevelName(log_level.upper()), int):
        raise _fail(f"--log-level {log_level}: one of DEBUG, INFO, WARNING, ERROR")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_config(config)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    quiet_transformers()
    from prfaas.decode_region.role import build_decode
    from prfaas.prefill_region.role import build_prefill
    from prfaas.region.main import serve

    try:
        serve(settings, {"prefill": build_prefill, "decode": build_decode})
    except (EngineError, OSError, ValueError) as exc:
        raise _fail(f"cannot start region {settings.name}: {exc}") from None


@app.command()
def up(
    topology: Path = typer.Option(None, "--topology", help="topology YAML (default examples/topology.yaml)"),
    model: str = typer.Option(None, help="catalog name or HF model folder (default: the topology's)"),
    emulate_wan: bool = typer.Option(False, help="regions in network namespaces joined by emulated WAN links (root)"),
    detach: bool = typer.Option(False, help="return once up; `prfaas down` stops it"),
    hosts: bool = typer.Option(
        False,
        help="every region instance in a namespace of its own, decode regions with two instances (root; "
        "implies --emulate-wan)",
    ),
    insecure: bool = typer.Option(False, help="plaintext between components (no certificates, no identities)"),
) -> None:
    """Start a whole deployment on this machine: Redis, the control plane, a Celery worker and
    every region of the topology, with mutual TLS between them; a demo tenant. Ctrl-C (or
    `prfaas down`) stops everything."""
    from rich.markup import escape

    from prfaas.devstack.preflight import check_policy
    from prfaas.devstack.state import UpError
    from prfaas.devstack.topology import DEFAULT_TOPOLOGY, TopologyError, load_topology
    from prfaas.devstack.up import Interrupted, claim_home, run_up
    from prfaas.engine.models import prfaas_home

    path = topology or DEFAULT_TOPOLOGY
    try:
        spec = load_topology(path)
        if model:
            spec = spec.model_copy(update={"model": model})
    except TopologyError as exc:
        raise _fail(str(exc)) from None
    try:
        check_policy(spec)  # before a model build makes a bad policy wait
        claim_home(prfaas_home())  # a deployment already up is said at once, and the home made 0700 first
    except (UpError, OSError) as exc:
        raise _fail(str(exc)) from None
    prepare_for_up(spec.name, spec.model)

    def say(message: str) -> None:  # a line naming a log keeps its path whole
        console.print(escape(message), soft_wrap=True)

    def ready(state: object) -> None:
        from prfaas.devstack.state import UpState

        assert isinstance(state, UpState)
        table = Table("", "", show_header=False)
        for label, value in (("API base", state.api_base), ("API key", state.api_key), ("admin key", state.admin_key),
                             ("dashboard", state.dashboard_url), ("logs", state.log_dir),
                             ("state", str(prfaas_home() / "up.json"))):  # fmt: skip
            table.add_row(label, value)
        console.print(table)
        console.print("[green]up[/green]" + ("" if detach else "; Ctrl-C or `prfaas down` stops it"))

    try:
        run_up(spec, str(path), prfaas_home(), emulate_wan, detach, say, ready, hosts=hosts, insecure=insecure)
    except Interrupted as exc:
        raise _fail(str(exc), 130) from None
    except UpError as exc:
        raise _fail(str(exc)) from None
    except Exception as exc:  # anything unforeseen is still one line, not a traceback (what started is stopped)
        logs = prfaas_home() / "up"
        raise _fail(f"up failed: {type(exc).__name__}: {exc} (logs in {logs})") from None


@app.command()
def down() -> None:
    """Stop what `prfaas up` started (processes, network namespaces)."""
    from rich.markup import escape

    from prfaas.devstack.state import UpError
    from prfaas.devstack.state import down as stop
    from prfaas.engine.models import prfaas_home

    try:
        found = stop(prfaas_home(), lambda m: console.print(escape(m), soft_wrap=True))
    except UpError as exc:
        raise _fail(str(exc)) from None
    console.print("down" if found else f"nothing is up ({prfaas_home() / 'up.json'} does not exist)")


app.command("bench")(bench_command)
app.command("tour")(tour_command)
app.command("trace")(trace_command)


app.add_typer(sim_app, name="sim")


regions_app = typer.Typer(help="The region registry: entries from Terraform outputs.", no_args_is_help=True)
app.add_typer(regions_app, name="regions")


@regions_app.command("import")
def regions_import(
    file: Path = typer.Argument(..., help="`terraform output -json` of a terraform/envs/* directory"),
    apply: bool = typer.Option(False, "--apply", help="PUT the links to the control plane's admin API"),
    url: str | None = typer.Option(None, help="API base URL (default: the outputs' control_plane.api_url)"),
    admin_key: str | None = typer.Option(None, envvar="PRFAAS_ADMIN_KEY", help="admin key (PRFAAS_ADMIN_KEY)"),
    as_json: bool = typer.Option(False, "--json", help="print the entries as JSON"),
) -> None:
    """Turn an environment's outputs into registry entries: regions (they register
    themselves when they start) and links; --apply configures the links. Exit 2 bad input."""
    import json

    import httpx

    from prfaas.control_plane.fleet.terraform_outputs import OutputsError, parse_outputs
    from prfaas.control_plane.fleet.terraform_outputs import apply as apply_links

    try:
        deployment = parse_outputs(file.read_text())
    except OSError as exc:
        raise _fail(f"{file}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise _fail(f"{file}: not UTF-8 text (byte {exc.start})") from None
    except OutputsError as exc:
        raise _fail(f"{file}: {exc}") from None
    if as_json:
        print(json.dumps({
            "regions": [r.model_dump() for r in deployment.regions],
            "links": [link.model_dump(exclude={"utilization"}) for link in deployment.links],
            "control_plane": deployment.control_plane.model_dump() if deployment.control_plane else None,
        }, indent=2))  # fmt: skip
    else:
        table = Table("region", "role", "provider", "location", "gpu", "$/GPU-h", "grpc", "kv")
        for r in deployment.regions:
            table.add_row(r.name, r.role, r.provider, r.location, r.gpu_type, f"{r.usd_per_gpu_hour:g}",
                          r.grpc_endpoint or "(registers)", r.kv_endpoint or "-")  # fmt: skip
        console.print(table)
        links = Table("link", "rtt ms", "Gbit/s", "egress $/GB")
        for link in deployment.links:
            links.add_row(f"{link.src} -> {link.dst}", f"{link.rtt_ms:g}", f"{link.bandwidth_gbps:g}",
                          f"{link.egress_usd_per_gb:g}")  # fmt: skip
        console.print(links)
    if not apply:
        return
    target = url or (deployment.control_plane.api_url if deployment.control_plane else None)
    if target is None:
        raise _fail("--apply needs --url (the outputs name no control_plane.api_url)")
    if not admin_key:
        raise _fail("--apply needs the admin key (--admin-key or PRFAAS_ADMIN_KEY)")
    try:
        report = apply_links(deployment, target, admin_key)
    except httpx.HTTPStatusError as exc:
        raise _fail(f"{target} refused: HTTP {exc.response.status_code} {exc.response.text[:200]}", 1) from None
    except httpx.HTTPError as exc:
        raise _fail(f"cannot reach {target}: {exc}", 1) from None
    registered, missing = ", ".join(report.registered) or "none", ", ".join(report.missing) or "none"
    console.print(f"put {report.links_put} link(s) to {target}; healthy: {registered}; not yet: {missing}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
