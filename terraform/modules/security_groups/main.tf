# Security groups in one VPC and their rules, one rule a resource
# (aws_vpc_security_group_{ingress,egress}_rule, each with a description). A rule's peer is a
# CIDR or a group of the same call (`peer`, its key; a group's own key for traffic between its
# members). Keys of `groups` and of each group's `rules` must be known at plan time; the rules'
# values need not be.

resource "aws_security_group" "this" {
  #checkov:skip=CKV2_AWS_5:the calling module attaches each group (launch template, load balancer, ECS services, ElastiCache, RDS) through the output `ids`, which checkov does not follow out of this module
  for_each    = var.groups
  name_prefix = each.value.name_prefix
  description = each.value.description
  vpc_id      = var.vpc_id
  tags        = var.tags
  lifecycle {
    create_before_destroy = true
  }
}

locals {
  # "GROUP/RULE" => the rule, its group and its peer group's id
  rules = merge([
    for name, group in var.groups : {
      for key, rule in group.rules : "${name}/${key}" => merge(rule, {
        group_id = aws_security_group.this[name].id
        peer_id  = rule.peer == null ? null : aws_security_group.this[rule.peer].id
      })
    }
  ]...)
}

resource "aws_vpc_security_group_ingress_rule" "this" {
  for_each                     = { for key, rule in local.rules : key => rule if rule.direction == "ingress" }
  security_group_id            = each.value.group_id
  description                  = each.value.description
  ip_protocol                  = each.value.protocol
  from_port                    = each.value.port
  to_port                      = each.value.port
  cidr_ipv4                    = each.value.cidr
  referenced_security_group_id = each.value.peer_id
}

resource "aws_vpc_security_group_egress_rule" "this" {
  for_each                     = { for key, rule in local.rules : key => rule if rule.direction == "egress" }
  security_group_id            = each.value.group_id
  description                  = each.value.description
  ip_protocol                  = each.value.protocol
  from_port                    = each.value.port
  to_port                      = each.value.port
  cidr_ipv4                    = each.value.cidr
  referenced_security_group_id = each.value.peer_id
}
