# The internal NLB regions send heartbeats through: TCP to the API tasks' registry port
# (gRPC), inside the peered private networks.

resource "aws_lb_target_group" "registry" {
  name_prefix = "preg-"
  port        = var.registry_port
  protocol    = "TCP"
  target_type = "ip"
  vpc_id      = var.vpc_id
  tags        = var.tags
}

resource "aws_lb_listener" "registry" {
  #checkov:skip=CKV2_AWS_74:the registry speaks plain gRPC over TCP inside the peered private networks; a TLS listener would need region-side TLS the region agent does not speak yet
  #checkov:skip=CKV_AWS_2:TCP listener of an internal NLB carrying gRPC, not HTTP
  #checkov:skip=CKV_AWS_103:TCP listener of an internal NLB, no TLS policy applies
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
  subnets                          = var.private_subnet_ids
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
