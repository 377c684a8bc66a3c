# Addresses before the shared kms_key, security_groups and service_roles modules. The rules
# keyed by CIDR cannot be moved (a moved block names its instance keys literally): the first
# apply after this change replaces them (docs/deploy.md, "Upgrading").

moved {
  from = aws_kms_key.this
  to   = module.kms.aws_kms_key.this
}

moved {
  from = aws_cloudwatch_log_group.region
  to   = module.kms.aws_cloudwatch_log_group.this["region"]
}

moved {
  from = aws_cloudwatch_log_group.flow[0]
  to   = module.kms.aws_cloudwatch_log_group.this["flow"]
}

moved {
  from = aws_security_group.region
  to   = module.security_groups.aws_security_group.this["region"]
}

moved {
  from = aws_vpc_security_group_egress_rule.https
  to   = module.security_groups.aws_vpc_security_group_egress_rule.this["region/https"]
}

moved {
  from = aws_vpc_security_group_ingress_rule.efa_self[0]
  to   = module.security_groups.aws_vpc_security_group_ingress_rule.this["region/efa-ingress"]
}

moved {
  from = aws_vpc_security_group_egress_rule.efa_self[0]
  to   = module.security_groups.aws_vpc_security_group_egress_rule.this["region/efa-egress"]
}

moved {
  from = aws_iam_role.region
  to   = module.roles.aws_iam_role.this["region"]
}

moved {
  from = aws_iam_role_policy.region
  to   = module.roles.aws_iam_role_policy.this["region/main"]
}

moved {
  from = aws_iam_role.flow[0]
  to   = module.roles.aws_iam_role.this["flow"]
}

moved {
  from = aws_iam_role_policy.flow[0]
  to   = module.roles.aws_iam_role_policy.this["flow/main"]
}
