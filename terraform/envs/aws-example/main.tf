# Prefill regions A and B, decode region C with the control plane in C's VPC; the prefill
# VPCs peer with C's (KV goes prefill -> decode over the peering, gRPC both ways).

locals {
  ticket_arn = module.control_plane.ticket_key_secret_arn
  # a replica secret has the primary's name and ARN suffix, in its own region
  replica_arn = {
    for r in [var.prefill_a.aws_region, var.prefill_b.aws_region] :
    r => replace(local.ticket_arn, ":${var.decode.aws_region}:", ":${r}:")
  }
  prefill_cidrs = [var.prefill_a.vpc_cidr, var.prefill_b.vpc_cidr]
}

module "decode" {
  source    = "../../modules/region_aws"
  providers = { aws = aws.decode }

  region = {
    name             = var.decode.name
    role             = "decode"
    gpu_type         = var.decode.gpu_type
    usd_per_gpu_hour = var.decode.usd_per_gpu_hour
    model            = var.model
    kv_buffer_bytes  = var.decode.kv_buffer_bytes
  }
  control_plane_url     = module.control_plane.registry_target
  instance_types        = var.decode.instance_types
  vpc_cidr              = var.decode.vpc_cidr
  availability_zones    = var.decode.availability_zones
  peer_cidrs            = local.prefill_cidrs
  control_plane_cidrs   = [var.decode.vpc_cidr]
  ticket_key_secret_arn = local.ticket_arn
  ticket_key_kms_arn    = module.control_plane.ticket_key_kms_arn
  prfaas_package        = var.prfaas_package
  enable_efa            = var.decode.enable_efa
  min_size              = var.decode.min_size
  max_size              = var.decode.max_size
  desired_capacity      = var.decode.min_size
}

module "control_plane" {
  source    = "../../modules/control_plane_aws"
  providers = { aws = aws.decode }

  name                       = var.name
  vpc_id                     = module.decode.vpc_id
  vpc_cidr                   = module.decode.vpc_cidr
  private_subnet_ids         = module.decode.private_subnet_ids
  public_subnet_ids          = module.decode.public_subnet_ids
  certificate_arn            = var.certificate_arn
  container_image            = var.container_image
  model                      = var.model
  region_cidrs               = local.prefill_cidrs
  ticket_key_replica_regions = [var.prefill_a.aws_region, var.prefill_b.aws_region]
}

module "prefill_a" {
  source    = "../../modules/region_aws"
  providers = { aws = aws.prefill_a }

  region = {
    name             = var.prefill_a.name
    role             = "prefill"
    gpu_type         = var.prefill_a.gpu_type
    usd_per_gpu_hour = var.prefill_a.usd_per_gpu_hour
    model            = var.model
  }
  control_plane_url       = module.control_plane.registry_target
  instance_types          = var.prefill_a.instance_types
  vpc_cidr                = var.prefill_a.vpc_cidr
  availability_zones      = var.prefill_a.availability_zones
  peer_cidrs              = [var.decode.vpc_cidr]
  control_plane_cidrs     = [var.decode.vpc_cidr]
  ticket_key_secret_arn   = local.replica_arn[var.prefill_a.aws_region]
  prfaas_package          = var.prfaas_package
  min_size                = var.prefill_a.min_size
  max_size                = var.prefill_a.max_size
  desired_capacity        = var.prefill_a.min_size
  on_demand_base_capacity = 0
}

module "prefill_b" {
  source    = "../../modules/region_aws"
  providers = { aws = aws.prefill_b }

  region = {
    name             = var.prefill_b.name
    role             = "prefill"
    gpu_type         = var.prefill_b.gpu_type
    usd_per_gpu_hour = var.prefill_b.usd_per_gpu_hour
    model            = var.model
  }
  control_plane_url       = module.control_plane.registry_target
  instance_types          = var.prefill_b.instance_types
  vpc_cidr                = var.prefill_b.vpc_cidr
  availability_zones      = var.prefill_b.availability_zones
  peer_cidrs              = [var.decode.vpc_cidr]
  control_plane_cidrs     = [var.decode.vpc_cidr]
  ticket_key_secret_arn   = local.replica_arn[var.prefill_b.aws_region]
  prfaas_package          = var.prfaas_package
  min_size                = var.prefill_b.min_size
  max_size                = var.prefill_b.max_size
  desired_capacity        = var.prefill_b.min_size
  on_demand_base_capacity = 0
}

# --- inter-region peering: each prefill VPC <-> the decode VPC -----------------------------

module "peer_a" {
  source    = "../../modules/vpc_peering"
  providers = { aws.requester = aws.prefill_a, aws.accepter = aws.decode }

  requester_vpc_id          = module.prefill_a.vpc_id
  requester_cidr            = module.prefill_a.vpc_cidr
  requester_route_table_ids = module.prefill_a.private_route_table_ids
  accepter_vpc_id           = module.decode.vpc_id
  accepter_region           = var.decode.aws_region
  accepter_cidr             = module.decode.vpc_cidr
  accepter_route_table_ids  = module.decode.private_route_table_ids
}

module "peer_b" {
  source    = "../../modules/vpc_peering"
  providers = { aws.requester = aws.prefill_b, aws.accepter = aws.decode }

  requester_vpc_id          = module.prefill_b.vpc_id
  requester_cidr            = module.prefill_b.vpc_cidr
  requester_route_table_ids = module.prefill_b.private_route_table_ids
  accepter_vpc_id           = module.decode.vpc_id
  accepter_region           = var.decode.aws_region
  accepter_cidr             = module.decode.vpc_cidr
  accepter_route_table_ids  = module.decode.private_route_table_ids
}
