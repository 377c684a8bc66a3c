# The control plane as processes on this host: a private Redis (unless redis_url names one),
# the API (uvicorn, also serving the region registry over gRPC) and a Celery worker. The
# local counterpart of control_plane_aws (ElastiCache, ALB + ECS); same outputs.

terraform {
  required_version = ">= 1.4"
}

locals {
  own_redis = var.redis_url == ""
  redis_url = local.own_redis ? "redis://${var.host}:${var.ports.redis}/0" : var.redis_url
  policy    = var.policy_yaml == "" ? "" : "${var.run_dir}/policy.yaml"
  settings = merge(
    {
      PYTHONUNBUFFERED     = "1"
      OMP_NUM_THREADS      = "1"
      PRFAAS_DEV           = var.dev ? "1" : "0"
      PRFAAS_REDIS_URL     = local.redis_url
      PRFAAS_KEY_PREFIX    = var.key_prefix
      PRFAAS_ADMIN_KEY     = var.admin_key
      PRFAAS_TICKET_KEY    = var.ticket_key
      PRFAAS_TICKET_KEY_ID = var.ticket_key_id
      PRFAAS_MODEL         = var.model
      PRFAAS_LEDGER_URL    = "sqlite:///${var.run_dir}/ledger.db"
    },
    local.policy == "" ? {} : { PRFAAS_POLICY_PATH = local.policy },
    var.extra_environment,
  )
  worker_name = "${var.key_prefix}-worker"
}

module "redis" {
  source = "../local_process"
  count  = local.own_redis ? 1 : 0

  name    = "${var.name_prefix}redis"
  run_dir = var.run_dir
  command = [
    var.redis_server, "--bind", var.host, "--port", tostring(var.ports.redis), "--save", "",
    "--appendonly", "no", "--dir", var.run_dir, "--protected-mode", "yes",
  ]
  ready_command   = "${var.redis_cli} -h ${var.host} -p ${var.ports.redis} ping | grep -q PONG"
  ready_timeout_s = 20
}

# the API and the worker: both need only Redis up (the API's readyz pings it); jobs wait in
# Redis until the worker consumes them
locals {
  services = {
    api = {
      command = [
        var.python, "-m", "uvicorn", "--factory", "prfaas.control_plane.app:app_from_env",
        "--host", var.host, "--port", tostring(var.ports.api), "--log-level", "warning",
      ]
      environment    = merge(local.settings, { PRFAAS_REGISTRY_LISTEN = "${var.host}:${var.ports.registry}" })
      config_file    = local.policy
      config_content = var.policy_yaml
      ready_command  = "${var.python} -c 'import sys, urllib.request; sys.exit(urllib.request.urlopen(\"http://${var.host}:${var.ports.api}/readyz\", timeout=1).status != 200)'"
    }
    worker = {
      command = [
        var.python, "-m", "celery", "-A", "prfaas.control_plane.worker", "worker", "--pool", "threads",
        "-c", tostring(var.worker_concurrency), "-n", "${local.worker_name}@%h", "--without-gossip",
        "--without-mingle", "--loglevel", "INFO",
      ]
      environment    = local.settings
      config_file    = ""
      config_content = ""
      # Celery logs "<name>@<host> ready." once it consumes the queue
      ready_command = "grep -q '${local.worker_name}@.* ready\\.' '${var.run_dir}/${var.name_prefix}worker.log'"
    }
    # exactly one: the metering schedule (price refresh, the ledger's reconciliation sweep: docs/metering.md)
    beat = {
      command = [
        var.python, "-m", "celery", "-A", "prfaas.control_plane.worker", "beat",
        "--schedule", "${var.run_dir}/${var.name_prefix}celerybeat-schedule", "--loglevel", "INFO",
      ]
      environment    = local.settings
      config_file    = ""
      config_content = ""
      ready_command  = "grep -q 'beat: Starting' '${var.run_dir}/${var.name_prefix}beat.log'"
    }
  }
}

module "service" {
  source     = "../local_process"
  for_each   = toset(keys(local.services))
  depends_on = [module.redis]

  name            = "${var.name_prefix}${each.key}"
  run_dir         = var.run_dir
  command         = local.services[each.key].command
  environment     = local.services[each.key].environment
  config_file     = local.services[each.key].config_file
  config_content  = local.services[each.key].config_content
  ready_command   = local.services[each.key].ready_command
  ready_timeout_s = var.ready_timeout_s
}
