# The same outputs as envs/local: `terraform output -json > outputs.json` then
# `prfaas regions import outputs.json --apply` (outputs.sample.json shows the shape).

output "control_plane" {
  description = "where tenants (the ALB) and regions (the registry's NLB) reach the control plane: {api_url, registry_target}"
  value       = module.control_plane.endpoints
}

output "regions" {
  description = "registry entries by region name"
  value       = { for slot in [module.slot_prefill_a, module.slot_prefill_b, module.slot_decode] : slot.region.name => slot.region }
}

output "links" {
  description = "directed prefill -> decode links for the registry"
  value = [
    for slot in local.prefill : merge({ src = local.region[slot].name, dst = local.region.decode.name }, var.links[slot])
  ]
}
