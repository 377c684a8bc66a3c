variable "region" {
  description = "the region interface: an object typed and defaulted by modules/region_config (docs/deploy.md)"
  type        = any
}

variable "control_plane_url" {
  description = "gRPC target of the control plane's registry (host:port): a control_plane_* module's registry_target"
  type        = string
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

variable "tls" {
  description = "mutual TLS files of the region (`prfaas certs init --identity prfaas://ROLE/NAME/*`): paths of the CA, the certificate and its key; null: plaintext, which the region allows only on a loopback host"
  type = object({
    ca   = string
    cert = string
    key  = string
  })
  default = null
  validation {
    condition     = alltrue([for path in values(coalesce(var.tls, { ca = "/", cert = "/", key = "/" })) : startswith(path, "/")])
    error_message = "tls: absolute file paths (PEM text would land in the rendered config file, which is not private)."
  }
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
