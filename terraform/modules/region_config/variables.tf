# The region interface, declared once: region_local and region_aws take the same `region`
# object (type `any` there) and pass it here; what they need of it they read back from the
# output `region` (this object with its defaults filled in). control_plane_url stays a
# variable of its own: it comes from the control plane's resources, and inside the object it
# would make every resource of a region wait for (and, in envs/aws-example, where the control
# plane runs in the decode region's VPC, depend in a cycle on) the control plane.

variable "region" {
  description = "the region interface (docs/deploy.md); name, role and model (the control plane's) are required"
  type = object({
    name                 = string                       # [a-z0-9-], at most 63 characters
    role                 = string                       # prefill, decode or both
    gpu_type             = optional(string, "cpu")      # reported to the registry
    usd_per_gpu_hour     = optional(number, 0)          # price the scheduler and the ledger use, $/GPU-hour
    model                = string                       # catalog name or HF model folder: the control plane's
    workers              = optional(number, 1)          # engine workers (concurrent prefills / decodes)
    kv_buffer_bytes      = optional(number, 268435456)  # decode KV buffer, bytes
    codec                = optional(string, "lossless") # KV codec when a request names none (docs/regions.md)
    dtype                = optional(string, "float32")  # engine dtype: float32, bfloat16, float16
    grpc_port            = optional(number, 50051)      # gRPC port of the region's services
    kv_port              = optional(number, 7400)       # KV port (decode role)
    metrics_port         = optional(number, 0)          # Prometheus /metrics port; 0: off
    ticket_key_id        = optional(string, "k1")       # id of the ticket key
    heartbeat_interval_s = optional(number, 1)          # heartbeat period, seconds
    drain_timeout_s      = optional(number, 5)          # SIGTERM: seconds running jobs may finish
  })
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.region.name))
    error_message = "region.name: [a-z0-9-], at most 63 characters, starting with a letter or digit."
  }
  validation {
    condition     = contains(["prefill", "decode", "both"], var.region.role)
    error_message = "region.role must be prefill, decode or both."
  }
  # the limits of prfaas region's own config (region/config.py RegionConfig), so that a plan
  # refuses what every instance would refuse at start
  validation {
    condition     = var.region.usd_per_gpu_hour >= 0 && var.region.usd_per_gpu_hour < pow(10, 308) # finite: a region reads 1e400 as inf
    error_message = "region.usd_per_gpu_hour: a finite number >= 0 (USD per GPU-hour)."
  }
  validation {
    condition     = floor(var.region.workers) == var.region.workers && var.region.workers >= 1 && var.region.workers <= 256
    error_message = "region.workers: a whole number from 1 to 256."
  }
  validation {
    condition     = floor(var.region.kv_buffer_bytes) == var.region.kv_buffer_bytes && var.region.kv_buffer_bytes > 0
    error_message = "region.kv_buffer_bytes: a whole number of bytes > 0."
  }
  validation {
    condition     = contains(["raw", "lossless", "fp8", "int8", "kv8", "kv6", "kv4", "kvw6", "kvw4"], var.region.codec)
    error_message = "region.codec: one of raw, lossless, fp8, int8, kv8, kv6, kv4, kvw6, kvw4 (docs/wire-format.md, \"Codec ids\")."
  }
  validation {
    condition     = contains(["auto", "float32", "bfloat16", "float16"], var.region.dtype)
    error_message = "region.dtype: auto, float32, bfloat16 or float16."
  }
  validation {
    condition = alltrue([
      for port in [var.region.grpc_port, var.region.kv_port, var.region.metrics_port] : floor(port) == port && port >= 0 && port <= 65535
    ]) && var.region.grpc_port >= 1 && var.region.kv_port >= 1
    error_message = "region.grpc_port, region.kv_port: a port from 1 to 65535; region.metrics_port: one too, or 0 (off)."
  }
  validation {
    condition = length(distinct([for port in [var.region.grpc_port, var.region.kv_port, var.region.metrics_port] : port if port != 0])) == length(
      [for port in [var.region.grpc_port, var.region.kv_port, var.region.metrics_port] : port if port != 0]
    )
    error_message = "region.grpc_port, region.kv_port and region.metrics_port (unless 0): each a different port."
  }
  validation {
    condition     = var.region.heartbeat_interval_s >= 0.05 && var.region.heartbeat_interval_s <= 60
    error_message = "region.heartbeat_interval_s: from 0.05 to 60 seconds."
  }
  validation {
    condition     = var.region.drain_timeout_s >= 0 && var.region.drain_timeout_s <= 3600
    error_message = "region.drain_timeout_s: from 0 to 3600 seconds."
  }
}

# --- wiring, and what the module that runs the region decides --------------------------

variable "control_plane_url" {
  description = "gRPC target of the control plane's registry (host:port)"
  type        = string
  # as the region's parser reads it: host:port or [v6 address]:port, grpc:// allowed, port 1-65535
  validation {
    condition = can(regex("^(grpc://)?(\\[[0-9A-Fa-f:.]+\\]|[^\\[\\]:/\\s]+):[0-9]{1,5}$", var.control_plane_url)) && try(
      tonumber(regex(":([0-9]+)$", var.control_plane_url)[0]) >= 1 && tonumber(regex(":([0-9]+)$", var.control_plane_url)[0]) <= 65535, false
    )
    error_message = "control_plane_url: the registry's host:port (or [v6 address]:port), port 1-65535."
  }
}

variable "registry" {
  description = "what the host module knows of the region for its registry entry (output `entry`): provider, location, instance_type, grpc_endpoint, kv_endpoint, cidr"
  type = object({
    provider      = string
    location      = string
    instance_type = optional(string)
    grpc_endpoint = optional(string) # null: each instance registers its own address
    kv_endpoint   = optional(string)
    cidr          = optional(string)
  })
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

variable "dev" {
  description = "allow placeholder secrets (never in production)"
  type        = bool
  default     = false
}

variable "tls" {
  description = "mutual TLS of the region (config `tls`): the deployment's CA, this region's certificate (identity prfaas://ROLE/NAME/* or /INSTANCE) and its key, each a file path or PEM text; null: none (then the region allows only loopback listen addresses)"
  type = object({
    ca   = string
    cert = string
    key  = string
  })
  default = null
}
