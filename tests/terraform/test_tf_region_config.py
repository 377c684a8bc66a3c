"""The region config the AWS module's cloud-init writes is one `prfaas region` accepts:
terraform/modules/region_config and region_aws's cloud-init template, rendered offline by
Terraform itself (pure module, built-in functions, no provider), then loaded with the real
parser (`load_config`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from tf_kit import NETNS, REPO, have_terraform

from prfaas.region.config import load_config

pytestmark = pytest.mark.skipif(not have_terraform(), reason="needs terraform on PATH and root (ip netns)")
MODULES = REPO / "terraform" / "modules"
SECRET = "arn:aws:secretsmanager:us-east-2:123456789012:secret:prfaas/example/ticket-key-AbCdEf"

CONFIG = f"""
module "region" {{
  source = "{MODULES / "region_config"}"
  region = {{
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
  }}
  registry          = {{ provider = "aws", location = "us-east-1", instance_type = "p5.48xlarge" }}
  control_plane_url = "prreg-0123.elb.us-east-1.amazonaws.com:7000"
  listen_host       = "0.0.0.0"
  device            = "cuda"
}}

output "cloud_init" {{
  value = templatefile("{MODULES / "region_aws" / "cloud-init.yaml.tftpl"}", {{
    region_yaml = module.region.yaml, package = "prfaas==0.1.0", secret_arn = "{SECRET}",
    aws_region = "us-east-2", log_group = "/prfaas/decode-use1/region", drain_timeout = 20
  }})
}}
"""


def test_cloud_init_writes_a_region_config_prfaas_region_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "main.tf").write_text(CONFIG)
    script = "terraform init -input=false >/dev/null && terraform apply -auto-approve -input=false >/dev/null && terraform output -json"  # noqa: E501
    out = subprocess.run(
        [str(NETNS), "run", "sh", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    cloud_init = yaml.safe_load(json.loads(out.stdout)["cloud_init"]["value"])
    files = {f["path"]: f["content"] for f in cloud_init["write_files"]}
    (tmp_path / "region.yaml").write_text(files["/etc/prfaas/region.yaml"])
    monkeypatch.setenv("PRFAAS_TICKET_KEY", "a-real-looking-ticket-key-0123456789abcdef")  # the start script's job
    config = load_config(tmp_path / "region.yaml")
    assert (config.name, config.role, config.workers, config.device, config.dtype) == (
        "decode-use1", "decode", 8, "cuda", "bfloat16",
    )  # fmt: skip
    assert (config.listen.grpc, config.listen.kv, config.listen.metrics) == (
        "0.0.0.0:50051",
        "0.0.0.0:7400",
        "0.0.0.0:9400",
    )
    assert config.kv_buffer_bytes == 64 << 30 and config.usd_per_gpu_hour == 12.29
    assert config.control_plane_url == "prreg-0123.elb.us-east-1.amazonaws.com:7000"
    assert "ticket_key:" not in files["/etc/prfaas/region.yaml"]  # the key comes from Secrets Manager at start
    start = files["/usr/local/bin/prfaas-region-start"]
    assert (
        f"--secret-id '{SECRET}'" in start
        and "exec /opt/prfaas/bin/prfaas region --config /etc/prfaas/region.yaml" in start
    )
    assert "TimeoutStopSec=30" in files["/etc/systemd/system/prfaas-region.service"]  # drain + 10 s
    assert "/opt/prfaas/bin/pip install --quiet 'prfaas==0.1.0'" in cloud_init["runcmd"]
