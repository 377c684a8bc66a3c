# A prfaas region on EC2: an auto-scaling group (spot/on-demand mix) of GPU instances whose
# cloud-init installs prfaas and runs `prfaas region --config` rendered from these variables.
# Each instance registers itself with the control plane's registry (heartbeats); the ticket
# key comes from Secrets Manager at start and never lands in the rendered config.

data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

data "aws_ssm_parameter" "gpu_ami" {
  count = var.ami_id == "" ? 1 : 0
  name  = var.ami_ssm_parameter
}

locals {
  region        = module.config.region
  ami_id        = var.ami_id != "" ? var.ami_id : data.aws_ssm_parameter.gpu_ami[0].insecure_value
  serves_decode = contains(["decode", "both"], local.region.role)
  user_data = templatefile("${path.module}/cloud-init.yaml.tftpl", {
    region_yaml   = module.config.yaml
    package       = var.prfaas_package
    secret_arn    = var.ticket_key_secret_arn
    aws_region    = data.aws_region.current.name
    log_group     = aws_cloudwatch_log_group.region.name
    drain_timeout = local.region.drain_timeout_s
  })
}

module "config" {
  source = "../region_config"

  region            = merge({ gpu_type = "l40s", dtype = "bfloat16" }, var.region)
  control_plane_url = var.control_plane_url
  listen_host       = "0.0.0.0"
  device            = "cuda"
}

resource "aws_kms_key" "this" {
  description             = "prfaas ${local.region.name}: EBS volumes and logs"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

data "aws_iam_policy_document" "kms" {
  # A key policy's resource "*" is the key itself (it cannot name its own ARN), and the
  # account root must administer it or the key becomes unmanageable:
  #checkov:skip=CKV_AWS_111:key policy; "*" is this key only
  #checkov:skip=CKV_AWS_356:key policy; "*" is this key only
  #checkov:skip=CKV_AWS_109:key policy; the account root keeps administration of its own key
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"] # in a key policy "*" means this key
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
  statement {
    sid       = "CloudWatchLogsEncrypt"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
  statement {
    sid       = "AutoScalingUsesForEBS"
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey", "kms:CreateGrant"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"]
    }
  }
}

resource "aws_cloudwatch_log_group" "region" {
  name              = "/prfaas/${local.region.name}/region"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = var.tags
}

# --- network access: only the KV port from peer regions, gRPC from the control plane -----

resource "aws_security_group" "region" {
  name_prefix = "prfaas-${local.region.name}-"
  description = "prfaas region ${local.region.name}: KV from peer regions, gRPC from the control plane"
  vpc_id      = local.vpc_id
  tags        = var.tags
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "kv" {
  for_each          = local.serves_decode ? toset(var.peer_cidrs) : toset([])
  security_group_id = aws_security_group.region.id
  description       = "KV shipments from prefill region ${each.value}"
  ip_protocol       = "tcp"
  from_port         = local.region.kv_port
  to_port           = local.region.kv_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_ingress_rule" "grpc" {
  # the control plane calls Reserve/Prefill/Decode; a decode region watches its prefill peer's health
  for_each          = toset(concat(var.control_plane_cidrs, var.peer_cidrs))
  security_group_id = aws_security_group.region.id
  description       = "prfaas gRPC from ${each.value}"
  ip_protocol       = "tcp"
  from_port         = local.region.grpc_port
  to_port           = local.region.grpc_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_ingress_rule" "metrics" {
  for_each          = local.region.metrics_port == 0 ? toset([]) : toset(var.metrics_cidrs)
  security_group_id = aws_security_group.region.id
  description       = "Prometheus scrape from ${each.value}"
  ip_protocol       = "tcp"
  from_port         = local.region.metrics_port
  to_port           = local.region.metrics_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_ingress_rule" "efa_self" {
  count                        = var.enable_efa ? 1 : 0
  security_group_id            = aws_security_group.region.id
  description                  = "EFA: all traffic between this region's instances (RDMA)"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.region.id
}

resource "aws_vpc_security_group_egress_rule" "efa_self" {
  count                        = var.enable_efa ? 1 : 0
  security_group_id            = aws_security_group.region.id
  description                  = "EFA: all traffic between this region's instances (RDMA)"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.region.id
}

resource "aws_vpc_security_group_egress_rule" "kv" {
  for_each          = contains(["prefill", "both"], local.region.role) ? toset(var.peer_cidrs) : toset([])
  security_group_id = aws_security_group.region.id
  description       = "KV shipments to decode region ${each.value}"
  ip_protocol       = "tcp"
  from_port         = local.region.kv_port
  to_port           = local.region.kv_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "registry" {
  for_each          = toset(var.control_plane_cidrs)
  security_group_id = aws_security_group.region.id
  description       = "registry heartbeats to the control plane in ${each.value}"
  ip_protocol       = "tcp"
  from_port         = var.registry_port
  to_port           = var.registry_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "peer_grpc" {
  # a decode region watches its prefill peer's gRPC health stream
  for_each          = toset(var.peer_cidrs)
  security_group_id = aws_security_group.region.id
  description       = "gRPC health of peer region ${each.value}"
  ip_protocol       = "tcp"
  from_port         = local.region.grpc_port
  to_port           = local.region.grpc_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "https" {
  security_group_id = aws_security_group.region.id
  description       = "HTTPS: package install, Secrets Manager, CloudWatch Logs (through NAT)"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

# --- least-privilege instance profile ---------------------------------------------------

data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "region" {
  name_prefix        = "prfaas-${substr(local.region.name, 0, 24)}-"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json
  tags               = var.tags
}

data "aws_iam_policy_document" "region" {
  statement {
    sid       = "ReadTicketKey"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [var.ticket_key_secret_arn]
  }
  dynamic "statement" {
    for_each = var.ticket_key_kms_arn == "" ? [] : [var.ticket_key_kms_arn]
    content {
      sid       = "DecryptTicketKey"
      actions   = ["kms:Decrypt"]
      resources = [statement.value]
    }
  }
  statement {
    sid       = "ShipLogs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${aws_cloudwatch_log_group.region.arn}:*"]
  }
}

resource "aws_iam_role_policy" "region" {
  role   = aws_iam_role.region.id
  policy = data.aws_iam_policy_document.region.json
}

resource "aws_iam_instance_profile" "region" {
  name_prefix = "prfaas-${substr(local.region.name, 0, 24)}-"
  role        = aws_iam_role.region.name
  tags        = var.tags
}

# --- instances ---------------------------------------------------------------------------

resource "aws_placement_group" "efa" {
  count    = var.enable_efa ? 1 : 0
  name     = "prfaas-${local.region.name}"
  strategy = "cluster"
  tags     = var.tags
}

resource "aws_launch_template" "region" {
  name_prefix   = "prfaas-${local.region.name}-"
  image_id      = local.ami_id
  instance_type = var.instance_types[0]
  user_data     = base64encode(local.user_data)
  ebs_optimized = true

  iam_instance_profile {
    arn = aws_iam_instance_profile.region.arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required" # IMDSv2 only
    http_put_response_hop_limit = 1
  }

  monitoring {
    enabled = true
  }

  block_device_mappings {
    device_name = var.root_device_name
    ebs {
      volume_size           = var.root_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = aws_kms_key.this.arn
      delete_on_termination = true
    }
  }

  network_interfaces {
    device_index                = 0
    interface_type              = var.enable_efa ? "efa" : null
    security_groups             = [aws_security_group.region.id]
    associate_public_ip_address = false
    delete_on_termination       = true
  }

  dynamic "placement" {
    for_each = var.enable_efa ? [1] : []
    content {
      group_name = aws_placement_group.efa[0].name
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "prfaas-${local.region.name}", "prfaas:region" = local.region.name, "prfaas:role" = local.region.role })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(var.tags, { "prfaas:region" = local.region.name })
  }

  tags = var.tags
}

resource "aws_autoscaling_group" "region" {
  name_prefix               = "prfaas-${local.region.name}-"
  min_size                  = var.min_size
  max_size                  = var.max_size
  desired_capacity          = var.desired_capacity
  vpc_zone_identifier       = local.private_subnet_ids
  health_check_type         = "EC2"
  health_check_grace_period = 600
  capacity_rebalance        = true
  # SIGTERM drains a region; give the lifecycle the same time
  default_instance_warmup = 300

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = var.on_demand_base_capacity
      on_demand_percentage_above_base_capacity = var.on_demand_percentage
      spot_allocation_strategy                 = "price-capacity-optimized"
    }
    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.region.id
        version            = "$Latest"
      }
      dynamic "override" {
        for_each = var.instance_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  instance_refresh {
    strategy = "Rolling"
    preferences {
      min_healthy_percentage = 50
    }
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = "prfaas-${local.region.name}", "prfaas:region" = local.region.name })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
