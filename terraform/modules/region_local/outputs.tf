output "region" {
  description = "the registry entry of this region (same shape as region_aws's)"
  value = {
    name             = local.region.name
    role             = local.region.role
    provider         = "local"
    location         = var.host
    gpu_type         = local.region.gpu_type
    instance_type    = null
    usd_per_gpu_hour = local.region.usd_per_gpu_hour
    grpc_endpoint    = "${var.host}:${local.region.grpc_port}"
    kv_endpoint      = local.region.role == "prefill" ? null : "${var.host}:${local.region.kv_port}"
    cidr             = null
  }
  depends_on = [module.process]
}

output "log_file" {
  description = "the region's log"
  value       = module.process.log_file
}
