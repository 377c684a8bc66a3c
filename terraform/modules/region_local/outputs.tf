output "region" {
  description = "the registry entry of this region (region_config's `entry`, as region_aws's)"
  value       = module.config.entry
  depends_on  = [module.process]
}

output "log_file" {
  description = "the region's log"
  value       = module.process.log_file
}
