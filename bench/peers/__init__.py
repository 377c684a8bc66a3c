"""prfaas.bench.peers: Mooncake and NIXL beside prfaas in the KV transport benchmarks (docs/transports-peers.md)."""
