# The `prfaas region --config` YAML of one region, from the region interface (variables.tf),
# and the region's registry entry.
# Pure (no resources, no provider): region_local and region_aws both render through it, so
# the two cannot drift, and the tests render it offline and load it with the real parser.
# The ticket key is never part of it (PRFAAS_TICKET_KEY in the process environment). `tls`
# (files from `prfaas certs init`) is what region_local passes. What only a running instance
# knows region_aws's start script appends at boot: `instance` and `advertise` from the
# instance metadata, `tls` naming the files it wrote from Secrets Manager. region_local keeps
# the config's defaults for those two (the host name, the listen host).

terraform {
  required_version = ">= 1.4"
}

locals {
  ports = ["grpc_port", "kv_port", "metrics_port"]
  config = merge(
    { for key, value in var.region : key => value if !contains(local.ports, key) },
    {
      control_plane_url = var.control_plane_url
      device            = var.device
      dev               = var.dev
      listen = {
        grpc    = "${var.listen_host}:${var.region.grpc_port}"
        kv      = "${var.listen_host}:${var.region.kv_port}"
        metrics = var.region.metrics_port == 0 ? null : "${var.listen_host}:${var.region.metrics_port}"
      }
    },
    var.tls == null ? {} : { tls = var.tls },
  )
}

output "yaml" {
  description = "the region config file's content"
  value       = yamlencode(local.config)
}

output "entry" {
  description = "the region's registry entry: region_local's and region_aws's output `region`, the same shape by construction"
  value = merge(var.registry, {
    name             = var.region.name
    role             = var.region.role
    gpu_type         = var.region.gpu_type
    usd_per_gpu_hour = var.region.usd_per_gpu_hour
  })
}

output "region" {
  description = "the region interface with its defaults filled in"
  value       = var.region
}
