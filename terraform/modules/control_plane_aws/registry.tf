# The internal NLB regions send heartbeats through: TCP to the API tasks' registry port
# (gRPC over mutual TLS, end to end), inside the peered private networks.

resource "aws_lb_target_group" "registry" {
  name_prefix = "preg-"
  port        = var.registry_port
  protocol    = "TCP"
  target_type = "ip"
  vpc_id      = var.vpc.id
  tags        = var.tags
}

resource "aws_lb_listener" "registry" {
  #checkov:skip=CKV2_AWS_74:the registry speaks mutual TLS end to end; TCP pass-through keeps the region's client certificate for the registry to check, a TLS listener would end TLS at the NLB
  #checkov:skip=CKV_AWS_2:TCP listener of an internal NLB carrying gRPC, not HTTP
  #checkov:skip=CKV_AWS_103:TCP pass-through of the mutual TLS between region and task, no listener TLS policy applies
  load_balancer_arn = aws_lb.registry.arn
  port              = var.registry_port
  protocol          = "TCP"
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.registry.arn
  }
  tags = var.tags
}

resource "aws_lb" "registry" {
  name_prefix                      = "prreg"
  load_balancer_type               = "network"
  internal                         = true
  subnets                          = var.subnet_ids.private
  enable_deletion_protection       = true
  enable_cross_zone_load_balancing = true
  tags                             = var.tags
  access_logs {
    # through the policy: the load balancer checks at creation that it may write there
    bucket  = aws_s3_bucket_policy.logs.bucket
    prefix  = "nlb"
    enabled = true
  }
}
