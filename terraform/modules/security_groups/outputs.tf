output "ids" {
  description = "security group ids by key"
  value       = { for key, group in aws_security_group.this : key => group.id }
}
