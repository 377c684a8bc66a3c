output "roles" {
  description = "the roles by key: {arn, name}"
  value       = { for key, role in aws_iam_role.this : key => { arn = role.arn, name = role.name } }
}
