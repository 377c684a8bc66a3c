# The same outputs as envs/local: `terraform output -json > outputs.json` then
# `prfaas regions import outputs.json --apply` (outputs.sample.json shows the shape).

output "control_plane" {
  description = "where tenants and regions reach the control plane"
  value = {
    api_url         = module.control_plane.api_url
    registry_target = module.control_plane.registry_target
  }
}

output "regions" {
  description = "registry entries by region name"
  value = {
    (module.prefill_a.region.name) = module.prefill_a.region
    (module.prefill_b.region.name) = module.prefill_b.region
    (module.decode.region.name)    = module.decode.region
  }
}

output "links" {
  description = "directed prefill -> decode links for the registry"
  value = [
    merge({ src = module.prefill_a.region.name, dst = module.decode.region.name }, var.links["prefill_a"]),
    merge({ src = module.prefill_b.region.name, dst = module.decode.region.name }, var.links["prefill_b"]),
  ]
}
