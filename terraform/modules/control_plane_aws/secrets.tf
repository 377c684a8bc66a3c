# Secrets in Secrets Manager, encrypted with this module's key: the admin key, the ticket
# key (replicated to every region that runs prfaas regions), the Redis URL with its auth
# token, the ledger URL with the database password. ECS injects them as PRFAAS_* variables.

data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  account_root = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"
}

resource "aws_kms_key" "this" {
  description             = "prfaas control plane ${var.name}: secrets, Redis, RDS, logs"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

data "aws_iam_policy_document" "kms" {
  # A key policy's resource "*" is the key itself (it cannot name its own ARN), and the
  # account root must administer it or the key becomes unmanageable:
  #checkov:skip=CKV_AWS_111:key policy; "*" is this key only
  #checkov:skip=CKV_AWS_356:key policy; "*" is this key only
  #checkov:skip=CKV_AWS_109:key policy; the account root keeps administration of its own key
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = [local.account_root]
    }
  }
  statement {
    sid       = "CloudWatchLogsEncrypt"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

resource "random_password" "admin_key" {
  length  = 48
  special = false
}

resource "random_password" "ticket_key" {
  length  = 48
  special = false
}

resource "random_password" "redis_auth" {
  length  = 64
  special = false
}

resource "random_password" "db" {
  length  = 40
  special = false
}

resource "aws_secretsmanager_secret" "admin_key" {
  #checkov:skip=CKV2_AWS_57:rotating the admin key is an operator action (new key, then update tenants' tooling); no Lambda can do it safely
  name_prefix = "prfaas/${var.name}/admin-key-"
  kms_key_id  = aws_kms_key.this.arn
  tags        = var.tags
}

resource "aws_secretsmanager_secret_version" "admin_key" {
  secret_id     = aws_secretsmanager_secret.admin_key.id
  secret_string = random_password.admin_key.result
}

resource "aws_secretsmanager_secret" "ticket_key" {
  #checkov:skip=CKV2_AWS_57:a new ticket key needs a new ticket_key_id rolled out to the control plane and every region together (docs/deploy.md); not a single-secret Lambda rotation
  name_prefix = "prfaas/${var.name}/ticket-key-"
  kms_key_id  = aws_kms_key.this.arn
  tags        = var.tags

  dynamic "replica" {
    for_each = var.ticket_key_replica_regions
    content {
      region     = replica.value
      kms_key_id = lookup(var.replica_kms_key_arns, replica.value, null)
    }
  }
}

resource "aws_secretsmanager_secret_version" "ticket_key" {
  secret_id     = aws_secretsmanager_secret.ticket_key.id
  secret_string = random_password.ticket_key.result
}

resource "aws_secretsmanager_secret" "redis_url" {
  #checkov:skip=CKV2_AWS_57:the auth token rotates through ElastiCache's AUTH rotation (ROTATE then SET), which this secret follows; a Lambda rotation would break the running API
  name_prefix = "prfaas/${var.name}/redis-url-"
  kms_key_id  = aws_kms_key.this.arn
  tags        = var.tags
}

resource "aws_secretsmanager_secret_version" "redis_url" {
  secret_id     = aws_secretsmanager_secret.redis_url.id
  secret_string = "rediss://:${random_password.redis_auth.result}@${aws_elasticache_replication_group.this.primary_endpoint_address}:6379/0"
}

resource "aws_secretsmanager_secret" "ledger_url" {
  #checkov:skip=CKV2_AWS_57:the ledger URL embeds the database password; rotate it with the RDS password (docs/deploy.md)
  name_prefix = "prfaas/${var.name}/ledger-url-"
  kms_key_id  = aws_kms_key.this.arn
  tags        = var.tags
}

resource "aws_secretsmanager_secret_version" "ledger_url" {
  secret_id     = aws_secretsmanager_secret.ledger_url.id
  secret_string = "postgresql+psycopg://prfaas:${random_password.db.result}@${aws_db_instance.ledger.address}:5432/prfaas?sslmode=require"
}
