locals {
  registry_target = "${var.host}:${var.ports.registry}"
}

output "endpoints" {
  description = "where tenants and regions reach the control plane: `api_url`, the API's base URL (OpenAI clients use API_URL/v1), and `registry_target` (an environment outputs it as `control_plane`)"
  value       = { api_url = "http://${var.host}:${var.ports.api}", registry_target = local.registry_target }
  depends_on  = [module.service]
}

output "registry_target" {
  description = "gRPC target of the region registry: the regions' control_plane_url"
  value       = local.registry_target
  # regions start once the registry serves (and the worker consumes), and stop before them
  depends_on = [module.service]
}

output "redis_url" {
  description = "Redis the control plane uses"
  value       = local.redis_url
}
