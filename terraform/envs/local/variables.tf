variable "python" {
  description = "Python interpreter with prfaas installed (the repository's .venv/bin/python)"
  type        = string
  default     = "python3"
}

variable "run_dir" {
  description = "absolute folder for PID files, logs and configs; empty: .run beside this file"
  type        = string
  default     = ""
}

variable "admin_key" {
  description = "admin API key (TF_VAR_admin_key)"
  type        = string
  sensitive   = true
}

variable "ticket_key" {
  description = "HMAC key of transfer tickets (TF_VAR_ticket_key)"
  type        = string
  sensitive   = true
}

variable "dev" {
  description = "allow placeholder secrets"
  type        = bool
  default     = false
}

variable "model" {
  description = "model every process serves"
  type        = string
  default     = "tiny-llama"
}

variable "policy_file" {
  description = "scheduler policy YAML; empty: the built-in default"
  type        = string
  default     = ""
}

variable "redis_url" {
  description = "an existing Redis; empty: the control plane starts a private one on redis_port"
  type        = string
  default     = ""
}

variable "api_port" {
  description = "API port"
  type        = number
  default     = 8000
}

variable "registry_port" {
  description = "registry gRPC port"
  type        = number
  default     = 7000
}

variable "redis_port" {
  description = "private Redis port"
  type        = number
  default     = 6390
}

variable "prefill_grpc_port" {
  description = "prefill region gRPC port"
  type        = number
  default     = 50061
}

variable "prefill_kv_port" {
  description = "prefill region KV port (unused by the prefill role, kept distinct)"
  type        = number
  default     = 7401
}

variable "decode_grpc_port" {
  description = "decode region gRPC port"
  type        = number
  default     = 50062
}

variable "decode_kv_port" {
  description = "decode region KV port"
  type        = number
  default     = 7402
}

variable "prefill_usd_per_gpu_hour" {
  description = "price of the prefill region"
  type        = number
  default     = 0.5
}

variable "decode_usd_per_gpu_hour" {
  description = "price of the decode region"
  type        = number
  default     = 4.0
}

variable "link_rtt_ms" {
  description = "RTT of the prefill -> decode link given to the registry"
  type        = number
  default     = 1
}

variable "link_bandwidth_gbps" {
  description = "bandwidth of the prefill -> decode link"
  type        = number
  default     = 10
}
