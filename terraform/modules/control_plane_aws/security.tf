# Security groups: tenants reach the ALB, the ALB the API tasks, the tasks Redis and the
# database; regions' heartbeats reach the tasks through the registry NLB.

locals {
  # with IP targets the NLB's own address (in vpc_cidr) is the source unless client IP
  # preservation is on (then the regions' CIDRs): both are allowed, nothing else
  region_sources = distinct(concat(var.region_cidrs, [var.vpc.cidr]))
}

module "security_groups" {
  source = "../security_groups"

  vpc_id = var.vpc.id
  groups = {
    alb = {
      name_prefix = "${local.name}-alb-"
      description = "prfaas ${var.name} ALB: HTTPS from tenants"
      rules = merge(
        {
          for pair in setproduct(var.tenant_cidrs, [80, 443]) : "ingress:${pair[0]}:${pair[1]}" => {
            direction   = "ingress", port = pair[1], cidr = pair[0]
            description = "${pair[1] == 443 ? "HTTPS" : "HTTP (redirected to HTTPS)"} from ${pair[0]}"
          }
        },
        { api = { direction = "egress", port = 8000, peer = "tasks", description = "to the API tasks" } },
      )
    }
    tasks = {
      name_prefix = "${local.name}-tasks-"
      description = "prfaas ${var.name} API and workers"
      rules = merge(
        { api = { direction = "ingress", port = 8000, peer = "alb", description = "HTTP from the ALB" } },
        {
          for cidr in local.region_sources : "ingress:registry:${cidr}" => {
            direction = "ingress", port = var.registry_port, cidr = cidr, description = "registry gRPC (heartbeats) from ${cidr}"
          }
        },
        {
          redis = { direction = "egress", port = 6379, peer = "redis", description = "to redis" }
          db    = { direction = "egress", port = 5432, peer = "db", description = "to db" }
          https = { direction = "egress", port = 443, cidr = "0.0.0.0/0", description = "HTTPS: image pulls, Secrets Manager, CloudWatch Logs (through NAT)" }
        },
        {
          for cidr in local.region_sources : "egress:regions:${cidr}" => {
            direction = "egress", port = var.region_grpc_port, cidr = cidr, description = "region gRPC (Reserve, Prefill, Decode) to ${cidr}"
          }
        },
      )
    }
    redis = {
      name_prefix = "${local.name}-redis-"
      description = "prfaas ${var.name} Redis: from the API and workers only"
      rules       = { tasks = { direction = "ingress", port = 6379, peer = "tasks", description = "Redis TLS from control-plane tasks" } }
    }
    db = {
      name_prefix = "${local.name}-db-"
      description = "prfaas ${var.name} ledger database: from the API and workers only"
      rules       = { tasks = { direction = "ingress", port = 5432, peer = "tasks", description = "PostgreSQL from control-plane tasks" } }
    }
  }
  tags = var.tags
}
