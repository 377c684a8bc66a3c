# A region as one `prfaas region --config` process on this host. Same interface as
# region_aws (the variables and the `region` output), minus the cloud's parts; the ticket
# key is a value here (a Secrets Manager ARN there). It reaches the process through the
# environment (PRFAAS_TICKET_KEY), never the rendered YAML.

terraform {
  required_version = ">= 1.4"
}

locals {
  config_file = "${var.run_dir}/${var.name}.yaml"
}

module "config" {
  source = "../region_config"

  name                 = var.name
  role                 = var.role
  gpu_type             = var.gpu_type
  workers              = var.workers
  usd_per_gpu_hour     = var.usd_per_gpu_hour
  model                = var.model
  kv_buffer_bytes      = var.kv_buffer_bytes
  codec                = var.codec
  grpc_port            = var.grpc_port
  kv_port              = var.kv_port
  metrics_port         = var.metrics_port
  control_plane_url    = var.control_plane_url
  ticket_key_id        = var.ticket_key_id
  heartbeat_interval_s = var.heartbeat_interval_s
  drain_timeout_s      = var.drain_timeout_s
  listen_host          = var.host
  dev                  = var.dev
}

module "process" {
  source = "../local_process"

  name           = var.name
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
  ready_command   = "grep -q '^ready region=${var.name} ' '${var.run_dir}/${var.name}.log'"
  ready_timeout_s = var.ready_timeout_s
  # SIGTERM drains: running jobs get drain_timeout_s
  stop_timeout_s = var.drain_timeout_s + 10
}
