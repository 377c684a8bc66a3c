# Prefill regions A and B, decode region C with the control plane in C's VPC; the prefill
# VPCs peer with C's (KV goes prefill -> decode over the peering, gRPC both ways). Each slot
# of `regions` is one call of ./slot (its region and, for a prefill slot, the peering).

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
      usd_per_gpu_hour = r.usd_per_gpu_hour, model = var.model, kv_buffer_bytes = r.kv_buffer_bytes,
      ticket_key_id    = var.ticket_key_id
    }
  }
  # what a slot's region is, before anything is created (./slot `slot`)
  slots = {
    for slot, r in var.regions : slot => merge(r, {
      region              = local.region[slot]
      tls_secret          = var.tls_secrets[slot]
      peer_cidrs          = slot == "decode" ? local.prefill_cidrs : [var.regions.decode.vpc_cidr]
      control_plane_cidrs = [var.regions.decode.vpc_cidr]
      # decode: region_aws's default of one on-demand instance; prefill: all spot
      on_demand_base_capacity = slot == "decode" ? 1 : 0
      prfaas_package          = var.prfaas_package
    })
  }
  # what it gets from the control plane (./slot `wiring`); the primary ticket key's KMS key
  # only in the decode region, a replica uses its region's aws/secretsmanager key
  wiring = {
    for slot in keys(var.regions) : slot => {
      control_plane_url = module.control_plane.registry_target
      ticket_key_secret = {
        arn     = local.ticket_arns[slot]
        kms_arn = slot == "decode" ? module.control_plane.ticket_key_kms_arn : ""
      }
    }
  }
  # a prefill slot's VPC peers with the decode slot's
  decode_vpc = {
    vpc_id          = module.slot_decode.vpc.id
    cidr            = module.slot_decode.vpc.cidr
    route_table_ids = module.slot_decode.private_route_table_ids
    aws_region      = var.regions.decode.aws_region
  }
}

module "slot_decode" {
  source    = "./slot"
  providers = { aws = aws.decode, aws.decode = aws.decode }
  slot      = local.slots.decode
  wiring    = local.wiring.decode
}

module "control_plane" {
  source    = "../../modules/control_plane_aws"
  providers = { aws = aws.decode }

  name                       = var.name
  vpc                        = module.slot_decode.vpc
  subnet_ids                 = module.slot_decode.subnet_ids
  certificate_arn            = var.certificate_arn
  container_image            = var.container_image
  model                      = var.model
  ticket_key_id              = var.ticket_key_id
  region_cidrs               = local.prefill_cidrs
  ticket_key_replica_regions = [for slot in local.prefill : var.regions[slot].aws_region]
  tls_secret                 = var.tls_secrets.control_plane
}

module "slot_prefill_a" {
  source    = "./slot"
  providers = { aws = aws.prefill_a, aws.decode = aws.decode }
  slot      = local.slots.prefill_a
  wiring    = merge(local.wiring.prefill_a, { peers = { decode = local.decode_vpc } })
}

module "slot_prefill_b" {
  source    = "./slot"
  providers = { aws = aws.prefill_b, aws.decode = aws.decode }
  slot      = local.slots.prefill_b
  wiring    = merge(local.wiring.prefill_b, { peers = { decode = local.decode_vpc } })
}
