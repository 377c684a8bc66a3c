# One slot of this environment (prefill_a, prefill_b, decode): its region (region_aws) and, for
# a prefill slot, the peering of its VPC with the decode slot's. One module for the three so
# that a slot is one call in ../main.tf: each call names its slot's provider configuration,
# which Terraform cannot choose with for_each.

terraform {
  required_providers {
    aws = {
      source                = "hashicorp/aws"
      version               = ">= 5.40"
      configuration_aliases = [aws.decode] # the accepter of the peering
    }
  }
}

variable "slot" {
  description = "the slot's settings, known before anything is created: its `regions` entry (../variables.tf) with `region` (the region interface), `tls_secret`, `peer_cidrs`, `control_plane_cidrs`, `on_demand_base_capacity` and `prfaas_package`"
  type        = any
}

variable "wiring" {
  description = "what comes from resources outside the slot: `control_plane_url` and `ticket_key_secret` ({arn, kms_arn}: the ticket key's secret in the slot's AWS region) from the control plane, `peers` (the VPCs to peer with by key, {vpc_id, cidr, route_table_ids, aws_region}: a prefill slot's is the decode slot's). Apart from `slot`, so that the decode slot's VPC does not wait for the control plane that runs in it (a cycle)"
  type = object({
    control_plane_url = string
    ticket_key_secret = object({ arn = string, kms_arn = string })
    peers = optional(map(object({
      vpc_id          = string
      cidr            = string
      route_table_ids = list(string)
      aws_region      = string
    })), {})
  })
}

module "region_aws" {
  source = "../../../modules/region_aws"

  region            = var.slot.region
  control_plane_url = var.wiring.control_plane_url
  tls_secret        = var.slot.tls_secret
  ticket_key_secret = var.wiring.ticket_key_secret
  prfaas_package    = var.slot.prfaas_package
  capacity = {
    instance_types          = var.slot.instance_types
    min_size                = var.slot.min_size
    max_size                = var.slot.max_size
    desired_capacity        = var.slot.min_size
    on_demand_base_capacity = var.slot.on_demand_base_capacity
  }
  vpc        = { cidr = var.slot.vpc_cidr, availability_zones = var.slot.availability_zones }
  cidrs      = { control_plane = var.slot.control_plane_cidrs, peers = var.slot.peer_cidrs }
  enable_efa = var.slot.enable_efa
}

# --- inter-region peering: this slot's VPC (requester) <-> the peer's (accepter) ----------

module "peering" {
  source    = "../../../modules/vpc_peering"
  for_each  = var.wiring.peers
  providers = { aws.requester = aws, aws.accepter = aws.decode }

  requester = { vpc_id = module.region_aws.vpc_id, cidr = module.region_aws.vpc_cidr, route_table_ids = module.region_aws.private_route_table_ids }
  accepter  = each.value
}

# what ../main.tf reads of region_aws's outputs, grouped by the resources they wait for: a
# reader waits for what it reads only (the control plane's security groups, replaced create
# before destroy, read the VPC alone; were they to wait for the subnets, so would those be)
output "region" {
  description = "the registry entry of the slot's region"
  value       = module.region_aws.region
}

output "vpc" {
  description = "the slot's VPC: {id, cidr}"
  value       = { id = module.region_aws.vpc_id, cidr = module.region_aws.vpc_cidr }
}

output "subnet_ids" {
  description = "its subnets: {private, public}"
  value       = { private = module.region_aws.private_subnet_ids, public = module.region_aws.public_subnet_ids }
}

output "private_route_table_ids" {
  description = "its private subnets' route tables (the peering's routes)"
  value       = module.region_aws.private_route_table_ids
}
