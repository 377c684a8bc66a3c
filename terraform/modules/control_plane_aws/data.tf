# State: ElastiCache Redis (TLS, auth token, encrypted, multi-AZ) for jobs, tenants, the
# registry and the Celery broker; RDS PostgreSQL (encrypted, private) for the ledger.

# both stores live in the private subnets
resource "aws_elasticache_subnet_group" "this" {
  name       = local.name
  subnet_ids = var.subnet_ids.private
  tags       = var.tags
}

resource "aws_db_subnet_group" "this" {
  name_prefix = "${local.name}-"
  subnet_ids  = var.subnet_ids.private
  tags        = var.tags
}

resource "aws_elasticache_replication_group" "this" {
  replication_group_id       = local.name
  description                = "prfaas ${var.name}: jobs, tenants, registry, Celery broker"
  engine                     = "redis"
  engine_version             = "7.1"
  node_type                  = var.redis_node_type
  num_cache_clusters         = 2
  port                       = 6379
  automatic_failover_enabled = true
  multi_az_enabled           = true
  subnet_group_name          = aws_elasticache_subnet_group.this.name
  security_group_ids         = [module.security_groups.ids["redis"]]
  at_rest_encryption_enabled = true
  kms_key_id                 = module.kms.arn
  transit_encryption_enabled = true
  auth_token                 = random_password.this["redis_auth"].result
  snapshot_retention_limit   = 7
  auto_minor_version_upgrade = true
  apply_immediately          = false
  tags                       = var.tags
}

resource "aws_db_parameter_group" "ledger" {
  name_prefix = "${local.name}-"
  family      = "postgres16"
  parameter {
    name  = "log_statement"
    value = "ddl"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }
  parameter {
    name         = "rds.force_ssl"
    value        = "1"
    apply_method = "pending-reboot"
  }
  tags = var.tags
}

resource "aws_db_instance" "ledger" {
  identifier_prefix                   = "${local.name}-"
  engine                              = "postgres"
  engine_version                      = "16"
  instance_class                      = var.db_instance_class
  allocated_storage                   = var.db_allocated_storage_gb
  db_name                             = "prfaas"
  username                            = "prfaas"
  password                            = random_password.this["db"].result
  db_subnet_group_name                = aws_db_subnet_group.this.name
  vpc_security_group_ids              = [module.security_groups.ids["db"]]
  parameter_group_name                = aws_db_parameter_group.ledger.name
  publicly_accessible                 = false
  storage_encrypted                   = true
  kms_key_id                          = module.kms.arn
  multi_az                            = true
  backup_retention_period             = 14
  deletion_protection                 = true
  copy_tags_to_snapshot               = true
  auto_minor_version_upgrade          = true
  iam_database_authentication_enabled = true
  monitoring_interval                 = 60
  monitoring_role_arn                 = module.roles.roles["rds-monitoring"].arn
  performance_insights_enabled        = true
  performance_insights_kms_key_id     = module.kms.arn
  enabled_cloudwatch_logs_exports     = ["postgresql", "upgrade"]
  skip_final_snapshot                 = false
  final_snapshot_identifier           = "${local.name}-final"
  tags                                = var.tags
}
