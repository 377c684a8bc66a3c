# The same outputs as envs/aws-example: `prfaas regions import` reads `terraform output -json`.

output "control_plane" {
  description = "where tenants and regions reach the control plane (inside the network namespace): {api_url, registry_target}"
  value       = module.control_plane.endpoints
}

output "regions" {
  description = "registry entries by region name"
  value       = { for region in module.region : region.region.name => region.region }
}

output "links" {
  description = "directed prefill -> decode links for the registry"
  value = [{
    src               = module.region["prefill"].region.name
    dst               = module.region["decode"].region.name
    rtt_ms            = var.link_rtt_ms
    bandwidth_gbps    = var.link_bandwidth_gbps
    egress_usd_per_gb = 0
  }]
}

output "run_dir" {
  description = "PID files and logs"
  value       = local.run_dir
}
