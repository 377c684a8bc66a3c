output "region" {
  description = "the registry entry of this region (same shape as region_aws's)"
  value = {
    name             = var.name
    role             = var.role
    provider         = "local"
    location         = var.host
    gpu_type         = var.gpu_type
    instance_type    = null
    usd_per_gpu_hour = var.usd_per_gpu_hour
    grpc_endpoint    = "${var.host}:${var.grpc_port}"
    kv_endpoint      = var.role == "prefill" ? null : "${var.host}:${var.kv_port}"
    cidr             = null
  }
  depends_on = [module.process]
}

output "log_file" {
  description = "the region's log"
  value       = module.process.log_file
}
