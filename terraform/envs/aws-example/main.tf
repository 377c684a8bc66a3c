# Prefill regions A and B, decode region C with the control plane in C's VPC; the prefill
# VPCs peer with C's (KV goes prefill -> decode over the peering, gRPC both ways).

locals {
  prefill    = ["prefill_a", "prefill_b"]
  ticket_arn = module.control_plane.ticket_key_secret_arn
  # a replica secret has the primary's name and ARN suffix, in its own region
  ticket_arns = {
    for slot, r in var.regions : slot => replace(local.ticket_arn, ":${var.regions.decode.aws_region}:", ":${r.aws_region}:")
  }
  prefill_cidrs = [for slot in local.prefill : var.regions[slot].vpc_cidr]
  # each slot's region interface (modules/region_config)
  region = {
    for slot, r in var.regions : slot => {
      name             = r.name, role = slot == "decode" ? "decode" : "prefill", gpu_type = r.gpu_type,
      usd_per_gpu_hour = r.usd_per_gpu_hour, model = var.model, kv_buffer_bytes = r.kv_buffer_bytes
    }
  }
}

module "decode" {
  source    = "../../modules/region_aws"
  providers = { aws = aws.decode }

  region                = local.region.decode
  control_plane_url     = module.control_plane.registry_target
  instance_types        = var.regions.decode.instance_types
  vpc_cidr              = var.regions.decode.vpc_cidr
  availability_zones    = var.regions.decode.availability_zones
  peer_cidrs            = local.prefill_cidrs
  control_plane_cidrs   = [var.regions.decode.vpc_cidr]
  ticket_key_secret_arn = local.ticket_arns.decode
  tls_secret            = var.tls_secrets.decode
  ticket_key_kms_arn    = module.control_plane.ticket_key_kms_arn
  prfaas_package        = var.prfaas_package
  enable_efa            = var.regions.decode.enable_efa
  min_size              = var.regions.decode.min_size
  max_size              = var.regions.decode.max_size
  desired_capacity      = var.regions.decode.min_size
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
  ticket_key_replica_regions = [for slot in local.prefill : var.regions[slot].aws_region]
  tls_secret                 = var.tls_secrets.control_plane
}

module "prefill_a" {
  source    = "../../modules/region_aws"
  providers = { aws = aws.prefill_a }

  region                  = local.region.prefill_a
  control_plane_url       = module.control_plane.registry_target
  instance_types          = var.regions.prefill_a.instance_types
  vpc_cidr                = var.regions.prefill_a.vpc_cidr
  availability_zones      = var.regions.prefill_a.availability_zones
  peer_cidrs              = [var.regions.decode.vpc_cidr]
  control_plane_cidrs     = [var.regions.decode.vpc_cidr]
  ticket_key_secret_arn   = local.ticket_arns.prefill_a
  tls_secret              = var.tls_secrets.prefill_a
  prfaas_package          = var.prfaas_package
  min_size                = var.regions.prefill_a.min_size
  max_size                = var.regions.prefill_a.max_size
  desired_capacity        = var.regions.prefill_a.min_size
  on_demand_base_capacity = 0
}

module "prefill_b" {
  source    = "../../modules/region_aws"
  providers = { aws = aws.prefill_b }

  region                  = local.region.prefill_b
  control_plane_url       = module.control_plane.registry_target
  instance_types          = var.regions.prefill_b.instance_types
  vpc_cidr                = var.regions.prefill_b.vpc_cidr
  availability_zones      = var.regions.prefill_b.availability_zones
  peer_cidrs              = [var.regions.decode.vpc_cidr]
  control_plane_cidrs     = [var.regions.decode.vpc_cidr]
  ticket_key_secret_arn   = local.ticket_arns.prefill_b
  tls_secret              = var.tls_secrets.prefill_b
  prfaas_package          = var.prfaas_package
  min_size                = var.regions.prefill_b.min_size
  max_size                = var.regions.prefill_b.max_size
  desired_capacity        = var.regions.prefill_b.min_size
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
  accepter_region           = var.regions.decode.aws_region
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
  accepter_region           = var.regions.decode.aws_region
  accepter_cidr             = module.decode.vpc_cidr
  accepter_route_table_ids  = module.decode.private_route_table_ids
}
