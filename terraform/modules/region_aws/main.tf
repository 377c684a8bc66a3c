# A prfaas region on EC2: an auto-scaling group (spot/on-demand mix) of GPU instances whose
# cloud-init installs prfaas and runs `prfaas region --config` rendered from the `region`
# object. Each instance registers itself with the control plane's registry (heartbeats) as
# (region, its EC2 instance id), advertising its private address; both come from the
# instance metadata at start. Every connection is mutual TLS: the region's certificate
# (shared by its instances, prfaas://ROLE/NAME/*), its key and the CA come from one Secrets
# Manager secret at start (files 0600). The ticket key comes from Secrets Manager at start
# and never lands on disk.

data "aws_region" "current" {}
data "aws_partition" "current" {}

data "aws_ssm_parameter" "gpu_ami" {
  count = var.ami_id == "" ? 1 : 0
  name  = var.ami_ssm_parameter
}

module "config" {
  source = "../region_config"

  region            = merge({ gpu_type = "l40s", dtype = "bfloat16" }, var.region)
  control_plane_url = var.control_plane_url
  listen_host       = "0.0.0.0" # all addresses; peers dial the private one it advertises
  device            = "cuda"
  registry = {
    provider      = "aws"
    location      = data.aws_region.current.name
    instance_type = var.capacity.instance_types[0]
    cidr          = local.vpc_cidr # each instance registers its own endpoints
  }
}

# the operator's TLS secret of the region ({arn, kms_arn}), checked
module "tls_secret" {
  source = "../tls_secret"

  secret = var.tls_secret
}

locals {
  region         = module.config.region
  tls_secret     = module.tls_secret.secret
  ami_id         = var.ami_id != "" ? var.ami_id : data.aws_ssm_parameter.gpu_ami[0].insecure_value
  serves_decode  = contains(["decode", "both"], local.region.role)
  serves_prefill = contains(["prefill", "both"], local.region.role)
  user_data = templatefile("${path.module}/cloud-init.yaml.tftpl", {
    region_yaml       = module.config.yaml
    package           = var.prfaas_package
    ticket_secret_arn = var.ticket_key_secret.arn
    tls_secret_arn    = local.tls_secret.arn
    tls_secret_region = local.tls_secret.region
    aws_region        = data.aws_region.current.name
    log_group         = module.kms.log_groups["region"].name
    drain_timeout     = local.region.drain_timeout_s
    model             = local.region.model
    prfaas_home       = local.prfaas_home
    lifecycle_hook    = local.lifecycle_hook
    ready_timeout_s   = var.ready_timeout_s
  })
  prfaas_home    = "/var/lib/prfaas" # the prepared model's home, the same for runcmd and the unit
  lifecycle_hook = "prfaas-region-ready"
  # the two secrets an instance reads, and the keys they are encrypted with (empty: the
  # AWS-managed aws/secretsmanager key, which needs no grant here)
  secret_arns = [var.ticket_key_secret.arn, local.tls_secret.arn]
  secret_kms  = compact(distinct([var.ticket_key_secret.kms_arn, local.tls_secret.kms_arn]))
}

# the key of the EBS volumes and of the region's (and a created VPC's flow) logs
module "kms" {
  source = "../kms_key"

  description     = "prfaas ${local.region.name}: EBS volumes and logs"
  autoscaling_ebs = true
  log_groups = merge(
    { region = "/prfaas/${local.region.name}/region" },
    { for key, name in { flow = "/prfaas/${local.region.name}/vpc-flow" } : key => name if local.create_vpc },
  )
  log_retention_days = var.log_retention_days
  tags               = var.tags
}

# --- network access: only the KV port from peer regions, gRPC from the control plane -----

locals {
  # rules on one port for each CIDR of a list (a decode region watches its prefill peer's
  # gRPC health stream, hence gRPC both ways between peers)
  cidr_rules = [
    { direction = "ingress", name = "kv", port = local.region.kv_port, cidrs = local.serves_decode ? var.cidrs.peers : [], about = "KV shipments from prefill region" },
    { direction = "ingress", name = "grpc", port = local.region.grpc_port, cidrs = concat(var.cidrs.control_plane, var.cidrs.peers), about = "prfaas gRPC from" },
    { direction = "ingress", name = "metrics", port = local.region.metrics_port, cidrs = local.region.metrics_port == 0 ? [] : var.cidrs.metrics, about = "Prometheus scrape from" },
    { direction = "egress", name = "kv", port = local.region.kv_port, cidrs = local.serves_prefill ? var.cidrs.peers : [], about = "KV shipments to decode region" },
    { direction = "egress", name = "registry", port = var.registry_port, cidrs = var.cidrs.control_plane, about = "registry heartbeats to the control plane in" },
    { direction = "egress", name = "grpc", port = local.region.grpc_port, cidrs = var.cidrs.peers, about = "gRPC health of peer region" },
  ]
  rules = merge(
    merge([
      for rule in local.cidr_rules : {
        for cidr in distinct(rule.cidrs) : "${rule.direction}:${rule.name}:${cidr}" => {
          direction = rule.direction, port = rule.port, cidr = cidr, description = "${rule.about} ${cidr}"
        }
      }
    ]...),
    {
      https = { direction = "egress", port = 443, cidr = "0.0.0.0/0", description = "HTTPS: package install, Secrets Manager, CloudWatch Logs (through NAT)" }
    },
    {
      for direction in(var.enable_efa ? ["ingress", "egress"] : []) : "efa-${direction}" => {
        direction = direction, protocol = "-1", peer = "region", description = "EFA: all traffic between this region's instances (RDMA)"
      }
    },
  )
}

module "security_groups" {
  source = "../security_groups"

  vpc_id = local.vpc_id
  groups = {
    region = {
      name_prefix = "prfaas-${local.region.name}-"
      description = "prfaas region ${local.region.name}: KV from peer regions, gRPC from the control plane"
      rules       = local.rules
    }
  }
  tags = var.tags
}

# --- least-privilege instance profile (and the flow logs' role) -------------------------

data "aws_iam_policy_document" "region" {
  statement {
    sid       = "ReadTicketKeyAndTls"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = local.secret_arns
  }
  dynamic "statement" {
    for_each = length(local.secret_kms) == 0 ? [] : [local.secret_kms]
    content {
      sid       = "DecryptThoseSecrets"
      actions   = ["kms:Decrypt"]
      resources = statement.value
      # only for Secrets Manager reading them, in the secrets' own AWS regions
      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = distinct([for r in [data.aws_region.current.name, local.tls_secret.region] : "secretsmanager.${r}.amazonaws.com"])
      }
    }
  }
  # the start script completes its instance's launch lifecycle action once the region is ready:
  # it finds its group (a Describe action, which IAM cannot narrow to a resource), and may
  # complete actions only in this region's groups (by name and by the group's prfaas:region tag)
  statement {
    sid       = "FindItsGroup"
    actions   = ["autoscaling:DescribeAutoScalingInstances"]
    resources = ["*"]
  }
  statement {
    sid       = "CompleteItsLaunch"
    actions   = ["autoscaling:CompleteLifecycleAction"]
    resources = ["arn:${data.aws_partition.current.partition}:autoscaling:${data.aws_region.current.name}:*:autoScalingGroup:*:autoScalingGroupName/prfaas-${local.region.name}-*"]
    condition {
      test     = "StringEquals"
      variable = "autoscaling:ResourceTag/prfaas:region"
      values   = [local.region.name]
    }
  }
  statement {
    sid       = "ShipLogs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${module.kms.log_groups["region"].arn}:*"]
  }
}

module "roles" {
  source = "../service_roles"

  roles = merge(
    {
      region = { name_prefix = "prfaas-${substr(local.region.name, 0, 24)}-", service = "ec2.amazonaws.com", policies = { main = data.aws_iam_policy_document.region.json } }
    },
    {
      for key, role in {
        flow = { name_prefix = "prfaas-${substr(local.region.name, 0, 20)}-flow-", service = "vpc-flow-logs.amazonaws.com", policies = { main = one(data.aws_iam_policy_document.flow[*].json) } }
      } : key => role if local.create_vpc
    },
  )
  tags = var.tags
}

resource "aws_iam_instance_profile" "region" {
  name_prefix = "prfaas-${substr(local.region.name, 0, 24)}-"
  role        = module.roles.roles["region"].name
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
  instance_type = var.capacity.instance_types[0]
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
      kms_key_id            = module.kms.arn
      delete_on_termination = true
    }
  }

  network_interfaces {
    device_index                = 0
    interface_type              = var.enable_efa ? "efa" : null
    security_groups             = [module.security_groups.ids["region"]]
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
  min_size                  = var.capacity.min_size
  max_size                  = var.capacity.max_size
  desired_capacity          = var.capacity.desired_capacity
  vpc_zone_identifier       = local.private_subnet_ids
  health_check_type         = "EC2" # EC2 status checks; the region's own readiness is the launch hook below
  health_check_grace_period = 600
  capacity_rebalance        = true
  # in service only once its region is ready (the hook); a minute more for its first heartbeats
  # before an instance refresh or a scaling metric counts it
  default_instance_warmup = 60

  # a new instance waits (Pending:Wait) until its start script reports the region's `ready`
  # line (cloud-init.yaml.tftpl); not ready in ready_timeout_s (installs, model prepare and
  # load included): ABANDON, the group terminates it and launches another. AWS reads this
  # block only when it creates the group: an existing one gets the hook by the CLI
  # (docs/deploy.md, "Upgrading").
  initial_lifecycle_hook {
    name                 = local.lifecycle_hook
    lifecycle_transition = "autoscaling:EC2_INSTANCE_LAUNCHING"
    default_result       = "ABANDON"
    heartbeat_timeout    = var.ready_timeout_s
  }

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = var.capacity.on_demand_base_capacity
      on_demand_percentage_above_base_capacity = var.capacity.on_demand_percentage
      spot_allocation_strategy                 = "price-capacity-optimized"
    }
    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.region.id
        version            = "$Latest"
      }
      dynamic "override" {
        for_each = var.capacity.instance_types
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
