# One prefill and one decode region plus the control plane, as processes on this host.
# Only built-in Terraform resources: `terraform init` needs no download. Secrets come from
# TF_VAR_admin_key / TF_VAR_ticket_key. The Makefile and the tests run it inside a network
# namespace with only loopback (docs/deploy.md), so the control plane starts its own Redis.

terraform {
  required_version = ">= 1.4"
}

locals {
  run_dir = var.run_dir != "" ? var.run_dir : "${abspath(path.root)}/.run"
  # what differs between the two regions (the rest is in module "region")
  regions = {
    prefill = { name = "prefill-local", role = "prefill", usd_per_gpu_hour = var.prefill_usd_per_gpu_hour, grpc_port = var.prefill_grpc_port, kv_port = var.prefill_kv_port }
    decode  = { name = "decode-local", role = "decode", usd_per_gpu_hour = var.decode_usd_per_gpu_hour, grpc_port = var.decode_grpc_port, kv_port = var.decode_kv_port }
  }
}

module "control_plane" {
  source = "../../modules/control_plane_local"

  python             = var.python
  run_dir            = local.run_dir
  ports              = { api = var.api_port, registry = var.registry_port, redis = var.redis_port }
  redis_url          = var.redis_url
  admin_key          = var.admin_key
  ticket_key         = var.ticket_key
  model              = var.model
  policy_yaml        = var.policy_file == "" ? "" : file(var.policy_file)
  worker_concurrency = 2
  dev                = var.dev
  extra_environment  = { PRFAAS_JOB_TIMEOUT_S = "120" }
}

module "region" {
  source   = "../../modules/region_local"
  for_each = local.regions

  region = merge(each.value, {
    model                = var.model
    codec                = "raw"
    heartbeat_interval_s = 0.5
  })
  control_plane_url = module.control_plane.registry_target
  ticket_key        = var.ticket_key
  python            = var.python
  run_dir           = local.run_dir
  dev               = var.dev
}
