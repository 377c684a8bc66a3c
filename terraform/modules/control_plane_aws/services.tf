# The API (uvicorn; also the registry's gRPC on registry_port) and the Celery workers as ECS
# Fargate services in private subnets. Tenants reach the API through the ALB (HTTPS); regions
# reach the registry through an internal NLB (TCP pass-through: mutual TLS from the region to
# the task, so the registry sees the region's certificate). Both services dial regions with
# the control plane's certificate (PRFAAS_TLS_*, ECS reads them at task start).

# the operator's TLS secret of the control plane ({arn, kms_arn}), checked
module "tls_secret" {
  source = "../tls_secret"

  secret = var.tls_secret
}

locals {
  name       = "prfaas-${var.name}" # every resource's name, or the start of it
  tls_secret = module.tls_secret.secret
  env = [
    { name = "PRFAAS_MODEL", value = var.model },
    { name = "PRFAAS_TICKET_KEY_ID", value = var.ticket_key_id },
    { name = "PRFAAS_KEY_PREFIX", value = "prfaas" },
  ]
  # this module's secrets, then the control plane's certificate, key and CA: the JSON keys of
  # the operator's TLS secret (PEM text in PRFAAS_TLS_*, which the settings accept); each
  # service gets those it names (`secrets` below)
  secret_env = merge(
    { for name in local.secret_names : name => { name = "PRFAAS_${upper(name)}", valueFrom = aws_secretsmanager_secret.this[name].arn } },
    { for key in ["ca", "cert", "key"] : "tls_${key}" => { name = "PRFAAS_TLS_${upper(key)}", valueFrom = "${local.tls_secret.arn}:${key}::" } },
  )
  # What every process needs: Settings requires admin_key and ticket_key in each (a worker and
  # the beat use no admin key, but refuse to start without one: control_plane/settings.py),
  # the broker and job store (redis_url), and the database (ledger_url: each process opens it
  # and migrates it at start, control_plane/services.py, the beat included, as it imports the
  # worker's app): all four. The certificate only where regions are dialled or the registry is
  # served. In the order of before, so the API's and the workers' task definitions stay as they were.
  secrets_every_process = local.secret_names
  secrets_tls           = ["tls_ca", "tls_cert", "tls_key"]
  log_options = {
    awslogs-group         = module.kms.log_groups["control-plane"].name
    awslogs-region        = data.aws_region.current.name
    awslogs-stream-prefix = "prfaas"
  }
  # the two services: what differs between them
  services = {
    api = {
      cpu    = var.api_cpu
      memory = var.api_memory
      count  = var.api_count
      # port 8000 admits the ALB alone (security.tf): its X-Forwarded-Proto is trusted, so the app sees https
      # and the dashboard's cookies are Secure (uvicorn trusts only 127.0.0.1 by default)
      command = ["uvicorn", "--factory", "prfaas.control_plane.app:app_from_env", "--host", "0.0.0.0",
      "--port", "8000", "--proxy-headers", "--forwarded-allow-ips", "*"]
      environment = concat(local.env, [
        { name = "PRFAAS_REGISTRY_LISTEN", value = "0.0.0.0:${var.registry_port}" },
        { name = "PRFAAS_SHUTDOWN_TIMEOUT_S", value = tostring(var.api_shutdown_timeout_s) },
      ])
      secrets = concat(local.secrets_every_process, local.secrets_tls) # the registry's mutual TLS; it dials regions
      container = {
        portMappings = [{ containerPort = 8000, protocol = "tcp" }, { containerPort = var.registry_port, protocol = "tcp" }]
        # SIGTERM (after the ALB's deregistration delay), then the API's drain, then SIGKILL: never mid-drain
        stopTimeout = var.api_shutdown_timeout_s + 10
      }
      load_balancers = [
        { target_group_arn = aws_lb_target_group.api.arn, port = 8000 },
        { target_group_arn = aws_lb_target_group.registry.arn, port = var.registry_port },
      ]
    }
    worker = {
      cpu    = var.worker_cpu
      memory = var.worker_memory
      count  = var.worker_count
      command = ["celery", "-A", "prfaas.control_plane.worker", "worker", "--pool", "threads", "-c",
      tostring(var.worker_concurrency), "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
      environment    = local.env
      secrets        = concat(local.secrets_every_process, local.secrets_tls) # it dials regions (Reserve, Prefill, Decode)
      container      = {}
      load_balancers = []
    }
    # exactly one, never two during a deployment: the metering schedule (price refresh, the ledger's
    # reconciliation sweep: docs/metering.md); its schedule file on the task's /tmp volume
    beat = {
      cpu            = 256
      memory         = 512
      count          = 1
      command        = ["celery", "-A", "prfaas.control_plane.worker", "beat", "--schedule", "/tmp/celerybeat-schedule", "--loglevel", "INFO"]
      environment    = local.env
      secrets        = local.secrets_every_process # it only sends scheduled tasks: it dials no region
      container      = {}
      load_balancers = []
    }
  }
}

resource "aws_ecs_cluster" "this" {
  name = local.name
  setting {
    name  = "containerInsights"
    value = "enabled"
  }
  tags = var.tags
}

# --- IAM: the execution role reads exactly these secrets; the task role needs nothing (the price feeds then
# fall back to the price table: docs/deploy.md) ---

data "aws_iam_policy_document" "execution_secrets" {
  statement {
    actions   = ["secretsmanager:GetSecretValue"]
    resources = concat([for name in local.secret_names : aws_secretsmanager_secret.this[name].arn], [local.tls_secret.arn])
  }
  statement {
    actions   = ["kms:Decrypt"]
    resources = compact([module.kms.arn, local.tls_secret.kms_arn])
  }
}

module "roles" {
  source = "../service_roles"

  roles = {
    execution = {
      name_prefix      = "prfaas-${substr(var.name, 0, 20)}-exec-"
      service          = "ecs-tasks.amazonaws.com"
      policies         = { secrets = data.aws_iam_policy_document.execution_secrets.json }
      managed_policies = { ecs-task-execution = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonECSTaskExecutionRolePolicy" }
    }
    task = {
      name_prefix = "prfaas-${substr(var.name, 0, 20)}-task-"
      service     = "ecs-tasks.amazonaws.com"
    }
    rds-monitoring = {
      name_prefix      = "prfaas-${substr(var.name, 0, 20)}-rdsmon-"
      service          = "monitoring.rds.amazonaws.com"
      managed_policies = { enhanced-monitoring = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole" }
    }
  }
  tags = var.tags
}

# --- task definitions and services ---------------------------------------------------------

resource "aws_ecs_task_definition" "this" {
  for_each                 = local.services
  family                   = "${local.name}-${each.key}"
  requires_compatibilities = ["FARGATE"]
  network_mode             = "awsvpc"
  cpu                      = each.value.cpu
  memory                   = each.value.memory
  execution_role_arn       = module.roles.roles["execution"].arn
  task_role_arn            = module.roles.roles["task"].arn
  container_definitions = jsonencode([merge(each.value.container, {
    name                   = each.key
    image                  = var.container_image
    essential              = true
    readonlyRootFilesystem = true
    command                = each.value.command
    environment            = each.value.environment
    secrets                = [for name in each.value.secrets : local.secret_env[name]]
    mountPoints            = [{ sourceVolume = "tmp", containerPath = "/tmp" }]
    logConfiguration       = { logDriver = "awslogs", options = merge(local.log_options, { awslogs-stream-prefix = each.key }) }
  })])
  volume {
    name = "tmp"
  }
  tags = var.tags
}

resource "aws_ecs_service" "this" {
  for_each        = local.services
  name            = "${local.name}-${each.key}"
  cluster         = aws_ecs_cluster.this.id
  task_definition = aws_ecs_task_definition.this[each.key].arn
  desired_count   = each.value.count
  launch_type     = "FARGATE"
  # beat: the old task stops before the new one starts (two would send every scheduled task twice)
  deployment_maximum_percent         = each.key == "beat" ? 100 : 200
  deployment_minimum_healthy_percent = each.key == "beat" ? 0 : 100
  network_configuration {
    subnets          = var.subnet_ids.private
    security_groups  = [module.security_groups.ids["tasks"]]
    assign_public_ip = false
  }
  dynamic "load_balancer" {
    for_each = each.value.load_balancers
    content {
      target_group_arn = load_balancer.value.target_group_arn
      container_name   = each.key
      container_port   = load_balancer.value.port
    }
  }
  # the API's target groups must be behind a listener before the service registers in them
  depends_on = [aws_lb_listener.https, aws_lb_listener.registry]
  tags       = var.tags
}
