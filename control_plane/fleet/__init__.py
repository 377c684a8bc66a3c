"""prfaas.control_plane.fleet: the regions the control plane knows, as the scheduler sees them.

records.py    InstanceRecord, RegionRecord: a region as the sum of its instances; `pick`
registry.py   RegionRegistry: registrations, heartbeats, drains and links in Redis; `snapshot()`
link_rows.py  the operator-set links in the database, written back into a Redis that lost them
snapshots.py  the scheduler's ClusterSnapshot from the records and links (prices from billing's PriceBook)
server.py     the Registry gRPC service regions call (Register, Heartbeat, WebRTC signalling)
signaling.py  SignalRelay: WebRTC offers and answers through Redis
terraform_outputs.py  the entries and links a Terraform environment describes (`prfaas regions import`)
"""
