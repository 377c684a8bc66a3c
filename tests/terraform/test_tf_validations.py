"""What a plan refuses before anything is created, planned offline by Terraform itself: the
region interface's limits (terraform/modules/region_config, the same as the region's own parser,
region/config.py) and region_aws's own inputs (`enable_efa` needs one availability zone,
`ready_timeout_s` is a lifecycle hook's timeout). Each bad value is one module call of a single
plan, whose error must name the attribute; the good calls must plan cleanly.

region_aws needs the AWS provider, which this machine cannot download, so its variables.tf
alone is planned as a module (its validations read only its variables)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tf_kit import NETNS, REPO, have_terraform

pytestmark = pytest.mark.skipif(not have_terraform(), reason="needs terraform on PATH and root (ip netns)")
MODULES = REPO / "terraform" / "modules"
EXAMPLE = REPO / "terraform" / "envs" / "aws-example"

GOOD_REGION = 'name = "decode-a", role = "decode", model = "smollm2-135m"'
PORTS = "region.grpc_port, region.kv_port:"  # their range; DISTINCT: the three are different ports
DISTINCT = "region.grpc_port, region.kv_port and region.metrics_port (unless 0): each a different port"
URL = "control_plane_url: the registry's host:port"
# module name -> (the region's attributes besides GOOD_REGION's, or a control_plane_url; the
# start of the error that names the attribute, None: it plans)
REGION_CASES: dict[str, tuple[str, str | None]] = {
    "defaults": ("", None),
    "auto_dtype_metrics_off": ('dtype = "auto", metrics_port = 0, kv_port = 7401', None),
    "every_limit_at_its_edge": (
        "workers = 256, usd_per_gpu_hour = 0, kv_buffer_bytes = 1, heartbeat_interval_s = 0.05,"
        " drain_timeout_s = 3600, grpc_port = 1, kv_port = 65535, metrics_port = 9400",
        None,
    ),
    "v6_registry": ("grpc://[2001:db8::1]:7000", None),
    "negative_price": ("usd_per_gpu_hour = -1", "region.usd_per_gpu_hour: a finite number >= 0"),
    "infinite_price": ("usd_per_gpu_hour = 1e400", "region.usd_per_gpu_hour: a finite number >= 0"),
    "no_workers": ("workers = 0", "region.workers: a whole number from 1 to 256"),
    "too_many_workers": ("workers = 257", "region.workers: a whole number from 1 to 256"),
    "half_a_worker": ("workers = 1.5", "region.workers: a whole number from 1 to 256"),
    "empty_kv_buffer": ("kv_buffer_bytes = 0", "region.kv_buffer_bytes: a whole number of bytes > 0"),
    "unknown_codec": ('codec = "zstd"', "region.codec: one of raw, lossless, fp8, int8, kv8, kv6, kv4, kvw6, kvw4"),
    "unknown_dtype": ('dtype = "int4"', "region.dtype: auto, float32, bfloat16 or float16"),
    "grpc_port_0": ("grpc_port = 0", PORTS),
    "kv_port_too_high": ("kv_port = 65536", PORTS),
    "negative_metrics_port": ("metrics_port = -1", PORTS),
    "grpc_on_kv_port": ("grpc_port = 7400", DISTINCT),
    "metrics_on_grpc_port": ("metrics_port = 50051", DISTINCT),
    "heartbeat_too_fast": ("heartbeat_interval_s = 0.01", "region.heartbeat_interval_s: from 0.05 to 60 seconds"),
    "heartbeat_too_slow": ("heartbeat_interval_s = 61", "region.heartbeat_interval_s: from 0.05 to 60 seconds"),
    "negative_drain": ("drain_timeout_s = -1", "region.drain_timeout_s: from 0 to 3600 seconds"),
    "drain_over_an_hour": ("drain_timeout_s = 3601", "region.drain_timeout_s: from 0 to 3600 seconds"),
    "registry_without_port": ("registry.internal", URL),
    "registry_port_0": ("registry.internal:0", URL),
    "registry_port_too_high": ("10.0.0.1:70000", URL),
    "registry_as_a_url": ("https://registry.internal:7000", URL),
}
AWS_INPUTS = 'region = {}\n  control_plane_url = "r:7000"\n  tls_secret = {}\n  ticket_key_secret = { arn = "a" }\n  cidrs = { control_plane = [] }'  # noqa: E501
AWS_CASES: dict[str, tuple[str, str | None]] = {
    "hook_timeout_too_short": ("ready_timeout_s = 10", "ready_timeout_s: whole seconds from 30 to 7200"),
    "hook_timeout_too_long": ("ready_timeout_s = 7201", "ready_timeout_s: whole seconds from 30 to 7200"),
}
# enable_efa's rule reads var.vpc too: Terraform checks such rules only once every rule of one
# variable passed, so these are a plan of their own
EFA_CASES: dict[str, tuple[str, str | None]] = {
    "efa_in_one_az": ('enable_efa = true\n  vpc = { availability_zones = ["us-east-1a"] }', None),
    "efa_in_one_subnet": ('enable_efa = true\n  vpc = { id = "vpc-1", private_subnet_ids = ["subnet-1"] }', None),
    "two_azs_without_efa": ('vpc = { availability_zones = ["us-east-1a", "us-east-1b"] }', None),
    "efa_over_two_azs": (
        'enable_efa = true\n  vpc = { availability_zones = ["us-east-1a", "us-east-1b"] }',
        "enable_efa: a cluster placement group is in one availability zone",
    ),
    "efa_over_two_subnets": (
        'enable_efa = true\n  vpc = { id = "vpc-1", private_subnet_ids = ["subnet-1", "subnet-2"] }',
        "enable_efa: a cluster placement group is in one availability zone",
    ),
}


def _config() -> str:
    """The calls whose errors come from rules on one variable."""
    text = ""
    for name, (change, _) in REGION_CASES.items():
        url = change if "=" not in change and change else "registry.internal:7000"
        region = ", ".join(filter(None, [GOOD_REGION, change if "=" in change else ""]))
        text += (
            f'module "{name}" {{\n  source = "{MODULES / "region_config"}"\n  region = {{ {region} }}\n'
            f'  control_plane_url = "{url}"\n'
            '  registry = { provider = "aws", location = "us-east-1" }\n  listen_host = "0.0.0.0"\n}\n'
        )
    return text + _aws_calls(AWS_CASES)


def _aws_calls(cases: dict[str, tuple[str, str | None]]) -> str:
    return "".join(
        f'module "{name}" {{\n  source = "./region_aws_inputs"\n  {AWS_INPUTS}\n  {change}\n}}\n'
        for name, (change, _) in cases.items()
    )


def _efa_config() -> str:
    text = _aws_calls(EFA_CASES)
    # envs/aws-example's own slots, as its ./slot passes them to region_aws (root variables: its
    # variables.tf, beside this file)
    text += (
        'module "example" {\n  source = "./region_aws_inputs"\n  for_each = var.regions\n  '
        f"{AWS_INPUTS}\n  enable_efa = each.value.enable_efa\n"
        "  vpc = { cidr = each.value.vpc_cidr, availability_zones = each.value.availability_zones }\n}\n"
    )
    return text


EXAMPLE_VARS = """certificate_arn = "arn:aws:acm:us-east-1:123456789012:certificate/x"
container_image = "prfaas:test"
tls_secrets = {
  control_plane = { arn = "a" }, decode = { arn = "b" }, prefill_a = { arn = "c" }, prefill_b = { arn = "d" }
}
"""


def _plan(work: Path, config: str) -> dict[str, str]:
    """Plan `config` offline: module name -> the text of the errors reported in that call."""
    (work / "region_aws_inputs").mkdir()
    shutil.copy(MODULES / "region_aws" / "variables.tf", work / "region_aws_inputs" / "variables.tf")
    shutil.copy(EXAMPLE / "variables.tf", work / "example_variables.tf")
    (work / "main.tf").write_text(config)
    (work / "terraform.tfvars").write_text(EXAMPLE_VARS)
    script = "terraform init -input=false -no-color >/dev/null && terraform plan -input=false -no-color"
    out = subprocess.run([str(NETNS), "run", "sh", "-c", script], cwd=work, capture_output=True, text=True, timeout=180)
    found: dict[str, str] = {}
    for chunk in re.split(r"^(?:[╷│ ]*)Error: ", out.stdout + out.stderr, flags=re.M)[1:]:
        module = re.search(r'in module "(\w+)"', chunk)
        assert module is not None, chunk  # every error belongs to one call
        found[module.group(1)] = found.get(module.group(1), "") + chunk
    assert found or out.returncode == 0, out.stdout + out.stderr
    return found


@pytest.fixture(scope="module")
def errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every case planned (two plans): module name -> the text of the errors reported in that call."""
    return _plan(tmp_path_factory.mktemp("tf"), _config()) | _plan(tmp_path_factory.mktemp("tf"), _efa_config())


@pytest.mark.parametrize(
    ("module", "message"), [(n, m) for n, (_, m) in (REGION_CASES | AWS_CASES | EFA_CASES).items()]
)
def test_a_plan_refuses_what_the_region_would_naming_the_attribute(
    errors: dict[str, str], module: str, message: str | None
) -> None:
    if message is None:
        assert module not in errors, errors[module]
    else:
        assert module in errors, f"{module}: planned without an error"
        assert message in " ".join(errors[module].split()), errors[module]


def test_the_example_environment_passes_region_aws_checks(errors: dict[str, str]) -> None:
    # its decode slot's VPC spans two AZs for the control plane's ALB and RDS: no EFA there
    assert "example" not in errors, errors.get("example")
