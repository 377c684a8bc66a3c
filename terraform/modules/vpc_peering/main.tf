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

variable "requester_vpc_id" {
  description = "VPC asking for the peering"
  type        = string
}

variable "requester_cidr" {
  description = "its CIDR"
  type        = string
}

variable "requester_route_table_ids" {
  description = "its private route tables"
  type        = list(string)
}

variable "accepter_vpc_id" {
  description = "VPC accepting it"
  type        = string
}

variable "accepter_region" {
  description = "AWS region of the accepter"
  type        = string
}

variable "accepter_cidr" {
  description = "its CIDR"
  type        = string
}

variable "accepter_route_table_ids" {
  description = "its private route tables"
  type        = list(string)
}

resource "aws_vpc_peering_connection" "this" {
  provider    = aws.requester
  vpc_id      = var.requester_vpc_id
  peer_vpc_id = var.accepter_vpc_id
  peer_region = var.accepter_region
}

resource "aws_vpc_peering_connection_accepter" "this" {
  provider                  = aws.accepter
  vpc_peering_connection_id = aws_vpc_peering_connection.this.id
  auto_accept               = true
}

resource "aws_route" "requester" {
  provider                  = aws.requester
  count                     = length(var.requester_route_table_ids)
  route_table_id            = var.requester_route_table_ids[count.index]
  destination_cidr_block    = var.accepter_cidr
  vpc_peering_connection_id = aws_vpc_peering_connection.this.id
}

resource "aws_route" "accepter" {
  provider                  = aws.accepter
  count                     = length(var.accepter_route_table_ids)
  route_table_id            = var.accepter_route_table_ids[count.index]
  destination_cidr_block    = var.requester_cidr
  vpc_peering_connection_id = aws_vpc_peering_connection_accepter.this.id
}

output "peering_connection_id" {
  description = "the peering connection"
  value       = aws_vpc_peering_connection.this.id
}
