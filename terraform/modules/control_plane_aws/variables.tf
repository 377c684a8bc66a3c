variable "name" {
  description = "deployment name (resource names, log groups, secrets)"
  type        = string
  default     = "prod"
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,20}$", var.name))
    error_message = "name: [a-z0-9-], at most 21 characters."
  }
}

variable "vpc" {
  description = "the control plane's VPC: {id, cidr} (e.g. the decode region's: region_aws outputs vpc_id, vpc_cidr)"
  type = object({
    id   = string
    cidr = string
  })
}

variable "subnet_ids" {
  description = "subnets of that VPC: `private` (with a NAT route) for tasks, Redis, RDS and the registry NLB, `public` for the internet-facing ALB"
  type = object({
    private = list(string)
    public  = optional(list(string), [])
  })
}

variable "internal_api" {
  description = "ALB in the private subnets (tenants reach it over a private network)"
  type        = bool
  default     = false
}

variable "certificate_arn" {
  description = "ACM certificate of the API's HTTPS listener"
  type        = string
}

variable "tenant_cidrs" {
  description = "CIDRs allowed to reach the API"
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "region_cidrs" {
  description = "CIDRs of the regions' VPCs (registry heartbeats in, region gRPC out)"
  type        = list(string)
}

variable "tls_secret" {
  description = "the control plane's mutual-TLS material: a Secrets Manager secret in this AWS region holding JSON {\"ca\", \"cert\", \"key\"} (PEM text) from `prfaas certs init --identity prfaas://control-plane/NAME`, created by the operator so that no private key passes through Terraform (docs/deploy.md, \"Certificates\")"
  type        = any # {arn, kms_arn}: typed, defaulted and checked once, in modules/tls_secret
}

variable "container_image" {
  description = "image with prfaas installed (uvicorn and celery on PATH)"
  type        = string
}

variable "model" {
  description = "served model (the regions serve the same)"
  type        = string
  default     = "smollm2-135m"
}

variable "ticket_key_id" {
  description = "id of the ticket key"
  type        = string
  default     = "k1"
}

variable "ticket_key_replica_regions" {
  description = "AWS regions that run prfaas regions: the ticket key secret is replicated there"
  type        = list(string)
  default     = []
}

variable "replica_kms_key_arns" {
  description = "KMS key per replica region (absent: that region's aws/secretsmanager key)"
  type        = map(string)
  default     = {}
}

variable "registry_port" {
  description = "registry gRPC port (regions' control_plane_url)"
  type        = number
  default     = 7000
}

variable "region_grpc_port" {
  description = "regions' gRPC port"
  type        = number
  default     = 50051
}

variable "api_count" {
  description = "API tasks"
  type        = number
  default     = 2
}

variable "api_shutdown_timeout_s" {
  description = "the API's drain on SIGTERM (PRFAAS_SHUTDOWN_TIMEOUT_S): streams in flight go on this long, then end with a server_shutting_down error; ECS's stopTimeout is 10 s more (Fargate allows 120 s)"
  type        = number
  default     = 20
  validation {
    condition     = var.api_shutdown_timeout_s >= 0 && var.api_shutdown_timeout_s <= 110
    error_message = "api_shutdown_timeout_s must be in [0, 110]: ECS stops a Fargate task at most 120 s after SIGTERM."
  }
}

variable "api_cpu" {
  description = "API task CPU units"
  type        = number
  default     = 1024
}

variable "api_memory" {
  description = "API task memory, MiB (the tokenizer is loaded)"
  type        = number
  default     = 2048
}

variable "worker_count" {
  description = "Celery worker tasks"
  type        = number
  default     = 2
}

variable "worker_cpu" {
  description = "worker task CPU units"
  type        = number
  default     = 512
}

variable "worker_memory" {
  description = "worker task memory, MiB"
  type        = number
  default     = 1024
}

variable "worker_concurrency" {
  description = "threads per worker"
  type        = number
  default     = 8
}

variable "redis_node_type" {
  description = "ElastiCache node type"
  type        = string
  default     = "cache.t4g.medium"
}

variable "db_instance_class" {
  description = "RDS instance class of the ledger"
  type        = string
  default     = "db.t4g.medium"
}

variable "db_allocated_storage_gb" {
  description = "ledger storage"
  type        = number
  default     = 50
}

variable "log_retention_days" {
  description = "CloudWatch retention"
  type        = number
  default     = 365
}

variable "tags" {
  description = "tags on every resource of the control plane"
  type        = map(string)
  default     = {}
}
