# The API (uvicorn; also the registry's gRPC on registry_port) and the Celery workers as ECS
# Fargate services in private subnets. Tenants reach the API through the ALB (HTTPS); regions
# reach the registry through an internal NLB (TCP).

locals {
  env = [
    { name = "PRFAAS_MODEL", value = var.model },
    { name = "PRFAAS_TICKET_KEY_ID", value = var.ticket_key_id },
    { name = "PRFAAS_KEY_PREFIX", value = "prfaas" },
  ]
  secrets = [
    { name = "PRFAAS_ADMIN_KEY", valueFrom = aws_secretsmanager_secret.admin_key.arn },
    { name = "PRFAAS_TICKET_KEY", valueFrom = aws_secretsmanager_secret.ticket_key.arn },
    { name = "PRFAAS_REDIS_URL", valueFrom = aws_secretsmanager_secret.redis_url.arn },
    { name = "PRFAAS_LEDGER_URL", valueFrom = aws_secretsmanager_secret.ledger_url.arn },
  ]
  log_options = {
    awslogs-group         = aws_cloudwatch_log_group.this.name
    awslogs-region        = data.aws_region.current.name
    awslogs-stream-prefix = "prfaas"
  }
}

resource "aws_cloudwatch_log_group" "this" {
  name              = "/prfaas/${var.name}/control-plane"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = var.tags
}

resource "aws_ecs_cluster" "this" {
  name = "prfaas-${var.name}"
  setting {
    name  = "containerInsights"
    value = "enabled"
  }
  tags = var.tags
}

# --- IAM: the execution role reads exactly these secrets; the task role needs nothing ---

data "aws_iam_policy_document" "ecs_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ecs-tasks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "execution" {
  name_prefix        = "prfaas-${substr(var.name, 0, 20)}-exec-"
  assume_role_policy = data.aws_iam_policy_document.ecs_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "execution" {
  role       = aws_iam_role.execution.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonECSTaskExecutionRolePolicy"
}

data "aws_iam_policy_document" "execution_secrets" {
  statement {
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [for s in local.secrets : s.valueFrom]
  }
  statement {
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_role_policy" "execution_secrets" {
  role   = aws_iam_role.execution.id
  policy = data.aws_iam_policy_document.execution_secrets.json
}

resource "aws_iam_role" "task" {
  name_prefix        = "prfaas-${substr(var.name, 0, 20)}-task-"
  assume_role_policy = data.aws_iam_policy_document.ecs_assume.json
  tags               = var.tags
}

# --- task definitions and services ---------------------------------------------------------

resource "aws_ecs_task_definition" "api" {
  family                   = "prfaas-${var.name}-api"
  requires_compatibilities = ["FARGATE"]
  network_mode             = "awsvpc"
  cpu                      = var.api_cpu
  memory                   = var.api_memory
  execution_role_arn       = aws_iam_role.execution.arn
  task_role_arn            = aws_iam_role.task.arn
  container_definitions = jsonencode([{
    name                   = "api"
    image                  = var.container_image
    essential              = true
    readonlyRootFilesystem = true
    command = ["uvicorn", "--factory", "prfaas.control_plane.app:app_from_env", "--host", "0.0.0.0",
    "--port", "8000", "--proxy-headers"]
    environment      = concat(local.env, [{ name = "PRFAAS_REGISTRY_LISTEN", value = "0.0.0.0:${var.registry_port}" }])
    secrets          = local.secrets
    portMappings     = [{ containerPort = 8000, protocol = "tcp" }, { containerPort = var.registry_port, protocol = "tcp" }]
    mountPoints      = [{ sourceVolume = "tmp", containerPath = "/tmp" }]
    logConfiguration = { logDriver = "awslogs", options = merge(local.log_options, { awslogs-stream-prefix = "api" }) }
  }])
  volume {
    name = "tmp"
  }
  tags = var.tags
}

resource "aws_ecs_task_definition" "worker" {
  family                   = "prfaas-${var.name}-worker"
  requires_compatibilities = ["FARGATE"]
  network_mode             = "awsvpc"
  cpu                      = var.worker_cpu
  memory                   = var.worker_memory
  execution_role_arn       = aws_iam_role.execution.arn
  task_role_arn            = aws_iam_role.task.arn
  container_definitions = jsonencode([{
    name                   = "worker"
    image                  = var.container_image
    essential              = true
    readonlyRootFilesystem = true
    command = ["celery", "-A", "prfaas.control_plane.worker", "worker", "--pool", "threads", "-c",
    tostring(var.worker_concurrency), "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
    environment      = local.env
    secrets          = local.secrets
    mountPoints      = [{ sourceVolume = "tmp", containerPath = "/tmp" }]
    logConfiguration = { logDriver = "awslogs", options = merge(local.log_options, { awslogs-stream-prefix = "worker" }) }
  }])
  volume {
    name = "tmp"
  }
  tags = var.tags
}

resource "aws_security_group" "tasks" {
  name_prefix = "prfaas-${var.name}-tasks-"
  description = "prfaas ${var.name} API and workers"
  vpc_id      = var.vpc_id
  tags        = var.tags
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "api_from_alb" {
  security_group_id            = aws_security_group.tasks.id
  description                  = "HTTP from the ALB"
  ip_protocol                  = "tcp"
  from_port                    = 8000
  to_port                      = 8000
  referenced_security_group_id = aws_security_group.alb.id
}

resource "aws_vpc_security_group_ingress_rule" "registry" {
  # with IP targets the NLB's own address (in vpc_cidr) is the source unless client IP
  # preservation is on (then the regions' CIDRs): both are allowed, nothing else
  for_each          = toset(concat(var.region_cidrs, [var.vpc_cidr]))
  security_group_id = aws_security_group.tasks.id
  description       = "registry gRPC (heartbeats) from ${each.value}"
  ip_protocol       = "tcp"
  from_port         = var.registry_port
  to_port           = var.registry_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "tasks_state" {
  for_each = {
    redis = { port = 6379, sg = aws_security_group.redis.id }
    db    = { port = 5432, sg = aws_security_group.db.id }
  }
  security_group_id            = aws_security_group.tasks.id
  description                  = "to ${each.key}"
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
  referenced_security_group_id = each.value.sg
}

resource "aws_vpc_security_group_egress_rule" "tasks_regions" {
  for_each          = toset(concat(var.region_cidrs, [var.vpc_cidr]))
  security_group_id = aws_security_group.tasks.id
  description       = "region gRPC (Reserve, Prefill, Decode) to ${each.value}"
  ip_protocol       = "tcp"
  from_port         = var.region_grpc_port
  to_port           = var.region_grpc_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "tasks_https" {
  security_group_id = aws_security_group.tasks.id
  description       = "HTTPS: image pulls, Secrets Manager, CloudWatch Logs (through NAT)"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_ecs_service" "api" {
  name            = "prfaas-${var.name}-api"
  cluster         = aws_ecs_cluster.this.id
  task_definition = aws_ecs_task_definition.api.arn
  desired_count   = var.api_count
  launch_type     = "FARGATE"
  network_configuration {
    subnets          = var.private_subnet_ids
    security_groups  = [aws_security_group.tasks.id]
    assign_public_ip = false
  }
  load_balancer {
    target_group_arn = aws_lb_target_group.api.arn
    container_name   = "api"
    container_port   = 8000
  }
  load_balancer {
    target_group_arn = aws_lb_target_group.registry.arn
    container_name   = "api"
    container_port   = var.registry_port
  }
  depends_on = [aws_lb_listener.https, aws_lb_listener.registry]
  tags       = var.tags
}

resource "aws_ecs_service" "worker" {
  name            = "prfaas-${var.name}-worker"
  cluster         = aws_ecs_cluster.this.id
  task_definition = aws_ecs_task_definition.worker.arn
  desired_count   = var.worker_count
  launch_type     = "FARGATE"
  network_configuration {
    subnets          = var.private_subnet_ids
    security_groups  = [aws_security_group.tasks.id]
    assign_public_ip = false
  }
  tags = var.tags
}
