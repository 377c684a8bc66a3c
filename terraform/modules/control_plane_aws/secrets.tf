# Secrets in Secrets Manager, encrypted with this module's key: the admin key, the ticket
# key (replicated to every region that runs prfaas regions), the Redis URL with its auth
# token, the ledger URL with the database password. ECS injects each as PRFAAS_<NAME>
# (services.tf).

data "aws_region" "current" {}
data "aws_partition" "current" {}

# the key of the secrets, Redis, RDS and the control plane's (and WAF's) logs
module "kms" {
  source = "../kms_key"

  description = "prfaas control plane ${var.name}: secrets, Redis, RDS, logs"
  log_groups = {
    control-plane = "/prfaas/${var.name}/control-plane"
    waf           = "aws-waf-logs-${local.name}" # WAF requires this name prefix
  }
  log_retention_days = var.log_retention_days
  tags               = var.tags
}

locals {
  # the order of the tasks' `secrets` (a new order is a new task definition revision)
  secret_names = ["admin_key", "ticket_key", "redis_url", "ledger_url"]
  secret_values = {
    admin_key  = random_password.this["admin_key"].result
    ticket_key = random_password.this["ticket_key"].result
    redis_url  = "rediss://:${random_password.this["redis_auth"].result}@${aws_elasticache_replication_group.this.primary_endpoint_address}:6379/0"
    ledger_url = "postgresql+psycopg://prfaas:${random_password.this["db"].result}@${aws_db_instance.ledger.address}:5432/prfaas?sslmode=require"
  }
}

resource "random_password" "this" {
  for_each = { admin_key = 48, ticket_key = 48, redis_auth = 64, db = 40 }
  length   = each.value
  special  = false
}

resource "aws_secretsmanager_secret" "this" {
  # None of the four rotates as one secret with a Lambda: a new ticket key needs a new
  # ticket_key_id rolled out to the control plane and every region together (docs/deploy.md);
  # a new admin key goes with tenants' tooling (an operator action); the Redis auth token
  # rotates through ElastiCache's AUTH rotation (ROTATE then SET), which its URL follows; the
  # ledger URL embeds the database password and rotates with it.
  #checkov:skip=CKV2_AWS_57:rotation is not a one-secret Lambda for any of the four (see above)
  for_each    = toset(local.secret_names)
  name_prefix = "prfaas/${var.name}/${replace(each.key, "_", "-")}-"
  kms_key_id  = module.kms.arn
  tags        = var.tags

  dynamic "replica" {
    for_each = each.key == "ticket_key" ? var.ticket_key_replica_regions : []
    content {
      region     = replica.value
      kms_key_id = lookup(var.replica_kms_key_arns, replica.value, null)
    }
  }
}

resource "aws_secretsmanager_secret_version" "this" {
  for_each      = aws_secretsmanager_secret.this
  secret_id     = each.value.id
  secret_string = local.secret_values[each.key]
}
