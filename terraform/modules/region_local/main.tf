# A region as one `prfaas region --config` process on this host. Same interface as
# region_aws (the `region` variable and output), minus the cloud's parts; the ticket key is
# a value here (a Secrets Manager ARN there). It reaches the process through the
# environment (PRFAAS_TICKET_KEY), never the rendered YAML. On loopback (the default host)
# the region needs no TLS; on another address it needs `tls` (files from `prfaas certs init`).
# The instance id is the region's default (the host name), the advertised address the host.

terraform {
  required_version = ">= 1.4"
}

module "config" {
  source = "../region_config"

  region            = var.region
  control_plane_url = var.control_plane_url
  listen_host       = var.host
  dev               = var.dev
  tls               = var.tls
  registry = {
    provider      = "local"
    location      = var.host
    grpc_endpoint = "${var.host}:${local.region.grpc_port}"
    kv_endpoint   = local.region.role == "prefill" ? null : "${var.host}:${local.region.kv_port}"
  }
}

locals {
  region      = module.config.region
  config_file = "${var.run_dir}/${local.region.name}.yaml"
}

module "process" {
  source = "../local_process"

  name           = local.region.name
  run_dir        = var.run_dir
  config_file    = local.config_file
  config_content = module.config.yaml
  command        = [var.python, "-m", "prfaas.cli.main", "region", "--config", local.config_file, "--log-level", "WARNING"]
  environment = {
    PRFAAS_TICKET_KEY = var.ticket_key
    PYTHONUNBUFFERED  = "1"
    OMP_NUM_THREADS   = tostring(var.omp_threads)
  }
  # `prfaas region` prints "ready region=... grpc=... kv=..." once it serves
  ready_command   = "grep -q '^ready region=${local.region.name} ' '${var.run_dir}/${local.region.name}.log'"
  ready_timeout_s = var.ready_timeout_s
  # SIGTERM drains: running jobs get drain_timeout_s
  stop_timeout_s = local.region.drain_timeout_s + 10
}
