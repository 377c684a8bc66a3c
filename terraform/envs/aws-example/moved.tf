# Addresses before ./slot: each region call and each peering moved into its slot's call.
# They can go once every state has been applied with them (docs/deploy.md, "Upgrading").

moved {
  from = module.decode
  to   = module.slot_decode.module.region_aws
}

moved {
  from = module.prefill_a
  to   = module.slot_prefill_a.module.region_aws
}

moved {
  from = module.peer_a
  to   = module.slot_prefill_a.module.peering["decode"]
}

moved {
  from = module.prefill_b
  to   = module.slot_prefill_b.module.region_aws
}

moved {
  from = module.peer_b
  to   = module.slot_prefill_b.module.peering["decode"]
}
