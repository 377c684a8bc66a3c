# The `prfaas region --config` YAML of one region, from the region interface's variables.
# Pure (no resources, no provider): region_local and region_aws both render through it, so
# the two cannot drift, and the tests render it offline and load it with the real parser.
# The ticket key is never part of it (PRFAAS_TICKET_KEY in the process environment).

terraform {
  required_version = ">= 1.4"
}

locals {
  config = {
    name                 = var.name
    role                 = var.role
    gpu_type             = var.gpu_type
    workers              = var.workers
    usd_per_gpu_hour     = var.usd_per_gpu_hour
    model                = var.model
    device               = var.device
    dtype                = var.dtype
    kv_buffer_bytes      = var.kv_buffer_bytes
    codec                = var.codec
    control_plane_url    = var.control_plane_url
    ticket_key_id        = var.ticket_key_id
    heartbeat_interval_s = var.heartbeat_interval_s
    drain_timeout_s      = var.drain_timeout_s
    dev                  = var.dev
    listen = {
      grpc    = "${var.listen_host}:${var.grpc_port}"
      kv      = "${var.listen_host}:${var.kv_port}"
      metrics = var.metrics_port == 0 ? null : "${var.listen_host}:${var.metrics_port}"
    }
  }
}

output "yaml" {
  description = "the region config file's content"
  value       = yamlencode(local.config)
}
