variable "python" {
  description = "Python interpreter with prfaas installed (e.g. the repository's .venv/bin/python)"
  type        = string
  default     = "python3"
}

variable "run_dir" {
  description = "absolute folder for PID files, logs, the policy file, the SQLite ledger"
  type        = string
}

variable "name_prefix" {
  description = "prefix of the process names (PID and log files)"
  type        = string
  default     = "cp-"
}

variable "host" {
  description = "address every process binds"
  type        = string
  default     = "127.0.0.1"
}

variable "ports" {
  description = "the ports it listens on, at host"
  type = object({
    api      = optional(number, 8000) # HTTP: the OpenAI-compatible and admin API
    registry = optional(number, 7000) # gRPC: the region registry (regions' control_plane_url)
    redis    = optional(number, 6390) # the private redis-server's (when redis_url is empty)
  })
  default = {}
}

variable "redis_url" {
  description = "an existing Redis; empty: start a private redis-server on ports.redis"
  type        = string
  default     = ""
}

variable "redis_server" {
  description = "redis-server binary"
  type        = string
  default     = "redis-server"
}

variable "redis_cli" {
  description = "redis-cli binary (readiness check)"
  type        = string
  default     = "redis-cli"
}

variable "key_prefix" {
  description = "prefix of every Redis key of this control plane"
  type        = string
  default     = "prfaas-local"
}

variable "admin_key" {
  description = "bearer key of the admin API (>= 32 characters unless dev)"
  type        = string
  sensitive   = true
}

variable "ticket_key" {
  description = "HMAC key of KV transfer tickets, shared with the regions"
  type        = string
  sensitive   = true
}

variable "ticket_key_id" {
  description = "id of ticket_key (key rotation)"
  type        = string
  default     = "k1"
}

variable "model" {
  description = "served model: catalog name or HF folder (the regions serve the same)"
  type        = string
  default     = "tiny-llama"
}

variable "policy_yaml" {
  description = "scheduler policy YAML (docs/scheduler.md); empty: the built-in default"
  type        = string
  default     = ""
}

variable "worker_concurrency" {
  description = "Celery worker threads"
  type        = number
  default     = 4
}

variable "dev" {
  description = "allow short or placeholder secrets (never in production)"
  type        = bool
  default     = false
}

variable "ready_timeout_s" {
  description = "seconds each process has to become ready"
  type        = number
  default     = 120
}

variable "extra_environment" {
  description = "more PRFAAS_* settings for the API and the worker (control_plane/settings.py)"
  type        = map(string)
  default     = {}
}
