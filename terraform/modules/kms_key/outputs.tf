output "arn" {
  description = "the key"
  value       = aws_kms_key.this.arn
}

output "log_groups" {
  description = "the log groups by key: {name, arn}"
  value       = { for key, group in aws_cloudwatch_log_group.this : key => { name = group.name, arn = group.arn } }
}
