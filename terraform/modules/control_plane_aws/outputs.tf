locals {
  registry_target = "${aws_lb.registry.dns_name}:${var.registry_port}"
}

output "endpoints" {
  description = "where tenants and regions reach the control plane: `api_url`, the API's base URL on the ALB (OpenAI clients use API_URL/v1), and `registry_target`, the registry's NLB (an environment outputs it as `control_plane`)"
  value       = { api_url = "https://${aws_lb.api.dns_name}", registry_target = local.registry_target }
}

output "registry_target" {
  description = "gRPC target of the region registry: the regions' control_plane_url (apart from `endpoints`, so that a region waits for the registry's NLB alone)"
  value       = local.registry_target
}

output "ticket_key_secret_arn" {
  description = "ARN of the ticket key secret in this region (replicas: same name, their region)"
  value       = aws_secretsmanager_secret.this["ticket_key"].arn
}

output "ticket_key_kms_arn" {
  description = "KMS key of the primary secret"
  value       = module.kms.arn
}

output "admin_key_secret_arn" {
  description = "ARN of the admin key secret"
  value       = aws_secretsmanager_secret.this["admin_key"].arn
}

output "security_group_id" {
  description = "security group of the API and worker tasks"
  value       = module.security_groups.ids["tasks"]
}
