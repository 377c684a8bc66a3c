# The region interface (region_local and region_aws pass theirs through).

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

variable "listen_host" {
  description = "address the region binds"
  type        = string
}

variable "device" {
  description = "torch device of the engine"
  type        = string
  default     = "cpu"
}

variable "dtype" {
  description = "engine dtype: float32, bfloat16, float16"
  type        = string
  default     = "float32"
}

variable "dev" {
  description = "allow placeholder secrets (never in production)"
  type        = bool
  default     = false
}
