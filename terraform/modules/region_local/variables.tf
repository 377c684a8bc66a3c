# --- the region interface shared with region_aws -------------------------------------

variable "name" {
  description = "region name, [a-z0-9-], at most 63 characters"
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.name))
    error_message = "name: [a-z0-9-], at most 63 characters, starting with a letter or digit."
  }
}

variable "role" {
  description = "prefill, decode or both"
  type        = string
  validation {
    condition     = contains(["prefill", "decode", "both"], var.role)
    error_message = "role must be prefill, decode or both."
  }
}

variable "gpu_type" {
  description = "reported to the registry"
  type        = string
  default     = "cpu"
}

variable "usd_per_gpu_hour" {
  description = "price the scheduler and the ledger use, $/GPU-hour"
  type        = number
  default     = 0
}

variable "model" {
  description = "catalog name or HF model folder; the same as the control plane's"
  type        = string
  default     = "tiny-llama"
}

variable "workers" {
  description = "engine workers (concurrent prefills / decodes)"
  type        = number
  default     = 1
}

variable "kv_buffer_bytes" {
  description = "decode KV buffer, bytes"
  type        = number
  default     = 268435456
}

variable "codec" {
  description = "KV codec when a request names none: raw, lossless, fp8, int8"
  type        = string
  default     = "lossless"
}

variable "grpc_port" {
  description = "gRPC port of the region's services"
  type        = number
  default     = 50051
}

variable "kv_port" {
  description = "KV port (decode role)"
  type        = number
  default     = 7400
}

variable "metrics_port" {
  description = "Prometheus /metrics port; 0: off"
  type        = number
  default     = 0
}

variable "control_plane_url" {
  description = "gRPC target of the control plane's registry (host:port)"
  type        = string
}

variable "ticket_key_id" {
  description = "id of the ticket key"
  type        = string
  default     = "k1"
}

variable "heartbeat_interval_s" {
  description = "heartbeat period, seconds"
  type        = number
  default     = 1
}

variable "drain_timeout_s" {
  description = "SIGTERM: seconds running jobs may finish"
  type        = number
  default     = 5
}

# --- local only ----------------------------------------------------------------------

variable "ticket_key" {
  description = "HMAC key of transfer tickets (the control plane's ticket_key)"
  type        = string
  sensitive   = true
}

variable "python" {
  description = "Python interpreter with prfaas installed"
  type        = string
  default     = "python3"
}

variable "run_dir" {
  description = "absolute folder for the PID file, the log and the rendered config"
  type        = string
}

variable "host" {
  description = "address the region binds (and advertises)"
  type        = string
  default     = "127.0.0.1"
}

variable "dev" {
  description = "allow placeholder secrets (never in production)"
  type        = bool
  default     = false
}

variable "omp_threads" {
  description = "OMP_NUM_THREADS of the engine"
  type        = number
  default     = 1
}

variable "ready_timeout_s" {
  description = "seconds the region has to load its model and serve"
  type        = number
  default     = 180
}
