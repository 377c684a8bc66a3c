output "region" {
  description = "the registry entry of this region (region_config's `entry`, as region_local's)"
  value       = module.config.entry
}

output "vpc_id" {
  description = "the region's VPC"
  value       = local.vpc_id
}

output "vpc_cidr" {
  description = "the region's VPC CIDR (peers open their ports to it)"
  value       = local.vpc_cidr
}

output "private_subnet_ids" {
  description = "subnets of the instances"
  value       = local.private_subnet_ids
}

output "public_subnet_ids" {
  description = "public subnets of a created VPC (NAT gateways; a load balancer may use them)"
  value       = aws_subnet.public[*].id
}

output "private_route_table_ids" {
  description = "route tables of a created VPC's private subnets (peering routes go here)"
  value       = aws_route_table.private[*].id
}

output "security_group_id" {
  description = "security group of the instances"
  value       = module.security_groups.ids["region"]
}

output "autoscaling_group_name" {
  description = "the region's auto-scaling group"
  value       = aws_autoscaling_group.region.name
}

output "log_group_name" {
  description = "CloudWatch log group of the region processes"
  value       = module.kms.log_groups["region"].name
}
