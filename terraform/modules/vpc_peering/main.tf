# One cross-region VPC peering and the routes both ways (private route tables only).

terraform {
  required_providers {
    aws = {
      source                = "hashicorp/aws"
      version               = ">= 5.40"
      configuration_aliases = [aws.requester, aws.accepter]
    }
  }
}

variable "requester" {
  description = "the VPC asking for the peering (provider aws.requester): {vpc_id, cidr, route_table_ids (its private route tables)}"
  type = object({
    vpc_id          = string
    cidr            = string
    route_table_ids = list(string)
  })
}

variable "accepter" {
  description = "the VPC accepting it (provider aws.accepter), the same and its AWS region: {vpc_id, cidr, route_table_ids, aws_region}"
  type = object({
    vpc_id          = string
    cidr            = string
    route_table_ids = list(string)
    aws_region      = string
  })
}

resource "aws_vpc_peering_connection" "this" {
  provider    = aws.requester
  vpc_id      = var.requester.vpc_id
  peer_vpc_id = var.accepter.vpc_id
  peer_region = var.accepter.aws_region
}

resource "aws_vpc_peering_connection_accepter" "this" {
  provider                  = aws.accepter
  vpc_peering_connection_id = aws_vpc_peering_connection.this.id
  auto_accept               = true
}

resource "aws_route" "requester" {
  provider                  = aws.requester
  count                     = length(var.requester.route_table_ids)
  route_table_id            = var.requester.route_table_ids[count.index]
  destination_cidr_block    = var.accepter.cidr
  vpc_peering_connection_id = aws_vpc_peering_connection.this.id
}

resource "aws_route" "accepter" {
  provider                  = aws.accepter
  count                     = length(var.accepter.route_table_ids)
  route_table_id            = var.accepter.route_table_ids[count.index]
  destination_cidr_block    = var.requester.cidr
  vpc_peering_connection_id = aws_vpc_peering_connection_accepter.this.id
}

output "peering_connection_id" {
  description = "the peering connection"
  value       = aws_vpc_peering_connection.this.id
}
