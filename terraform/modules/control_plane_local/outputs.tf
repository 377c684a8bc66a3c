output "api_url" {
  description = "base URL of the API (OpenAI clients use API_URL/v1)"
  value       = "http://${var.host}:${var.api_port}"
  depends_on  = [module.service]
}

output "registry_target" {
  description = "gRPC target of the region registry: the regions' control_plane_url"
  value       = "${var.host}:${var.registry_port}"
  # regions start once the registry serves (and the worker consumes), and stop before them
  depends_on = [module.service]
}

output "redis_url" {
  description = "Redis the control plane uses"
  value       = local.redis_url
}
