# Addresses before for_each and the shared kms_key, security_groups and service_roles
# modules: state moves with them (the random passwords, the key and the secrets keep their
# values). The ALB's and the registry's rules keyed by CIDR cannot be moved (a moved block
# names its instance keys literally): the first apply after this change replaces them
# (docs/deploy.md, "Upgrading").

moved {
  from = aws_kms_key.this
  to   = module.kms.aws_kms_key.this
}

moved {
  from = aws_cloudwatch_log_group.this
  to   = module.kms.aws_cloudwatch_log_group.this["control-plane"]
}

moved {
  from = aws_cloudwatch_log_group.waf
  to   = module.kms.aws_cloudwatch_log_group.this["waf"]
}

moved {
  from = random_password.admin_key
  to   = random_password.this["admin_key"]
}

moved {
  from = random_password.ticket_key
  to   = random_password.this["ticket_key"]
}

moved {
  from = random_password.redis_auth
  to   = random_password.this["redis_auth"]
}

moved {
  from = random_password.db
  to   = random_password.this["db"]
}

moved {
  from = aws_secretsmanager_secret.admin_key
  to   = aws_secretsmanager_secret.this["admin_key"]
}

moved {
  from = aws_secretsmanager_secret_version.admin_key
  to   = aws_secretsmanager_secret_version.this["admin_key"]
}

moved {
  from = aws_secretsmanager_secret.ticket_key
  to   = aws_secretsmanager_secret.this["ticket_key"]
}

moved {
  from = aws_secretsmanager_secret_version.ticket_key
  to   = aws_secretsmanager_secret_version.this["ticket_key"]
}

moved {
  from = aws_secretsmanager_secret.redis_url
  to   = aws_secretsmanager_secret.this["redis_url"]
}

moved {
  from = aws_secretsmanager_secret_version.redis_url
  to   = aws_secretsmanager_secret_version.this["redis_url"]
}

moved {
  from = aws_secretsmanager_secret.ledger_url
  to   = aws_secretsmanager_secret.this["ledger_url"]
}

moved {
  from = aws_secretsmanager_secret_version.ledger_url
  to   = aws_secretsmanager_secret_version.this["ledger_url"]
}

moved {
  from = aws_security_group.alb
  to   = module.security_groups.aws_security_group.this["alb"]
}

moved {
  from = aws_security_group.tasks
  to   = module.security_groups.aws_security_group.this["tasks"]
}

moved {
  from = aws_security_group.redis
  to   = module.security_groups.aws_security_group.this["redis"]
}

moved {
  from = aws_security_group.db
  to   = module.security_groups.aws_security_group.this["db"]
}

moved {
  from = aws_vpc_security_group_egress_rule.alb
  to   = module.security_groups.aws_vpc_security_group_egress_rule.this["alb/api"]
}

moved {
  from = aws_vpc_security_group_ingress_rule.api_from_alb
  to   = module.security_groups.aws_vpc_security_group_ingress_rule.this["tasks/api"]
}

moved {
  from = aws_vpc_security_group_egress_rule.tasks_state["redis"]
  to   = module.security_groups.aws_vpc_security_group_egress_rule.this["tasks/redis"]
}

moved {
  from = aws_vpc_security_group_egress_rule.tasks_state["db"]
  to   = module.security_groups.aws_vpc_security_group_egress_rule.this["tasks/db"]
}

moved {
  from = aws_vpc_security_group_egress_rule.tasks_https
  to   = module.security_groups.aws_vpc_security_group_egress_rule.this["tasks/https"]
}

moved {
  from = aws_vpc_security_group_ingress_rule.redis
  to   = module.security_groups.aws_vpc_security_group_ingress_rule.this["redis/tasks"]
}

moved {
  from = aws_vpc_security_group_ingress_rule.db
  to   = module.security_groups.aws_vpc_security_group_ingress_rule.this["db/tasks"]
}

moved {
  from = aws_iam_role.execution
  to   = module.roles.aws_iam_role.this["execution"]
}

moved {
  from = aws_iam_role_policy.execution_secrets
  to   = module.roles.aws_iam_role_policy.this["execution/secrets"]
}

moved {
  from = aws_iam_role_policy_attachment.execution
  to   = module.roles.aws_iam_role_policy_attachment.this["execution/ecs-task-execution"]
}

moved {
  from = aws_iam_role.task
  to   = module.roles.aws_iam_role.this["task"]
}

moved {
  from = aws_iam_role.rds_monitoring
  to   = module.roles.aws_iam_role.this["rds-monitoring"]
}

moved {
  from = aws_iam_role_policy_attachment.rds_monitoring
  to   = module.roles.aws_iam_role_policy_attachment.this["rds-monitoring/enhanced-monitoring"]
}

moved {
  from = aws_ecs_task_definition.api
  to   = aws_ecs_task_definition.this["api"]
}

moved {
  from = aws_ecs_service.api
  to   = aws_ecs_service.this["api"]
}

moved {
  from = aws_ecs_task_definition.worker
  to   = aws_ecs_task_definition.this["worker"]
}

moved {
  from = aws_ecs_service.worker
  to   = aws_ecs_service.this["worker"]
}
