variable "name" {
  description = "process name: the PID file is RUN_DIR/NAME.pid, the log RUN_DIR/NAME.log"
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]*$", var.name))
    error_message = "name: lower-case letters, digits and '-'."
  }
}

variable "run_dir" {
  description = "absolute folder for PID files, logs and rendered configs"
  type        = string
  validation {
    condition     = startswith(var.run_dir, "/") && !strcontains(var.run_dir, "'")
    error_message = "run_dir must be an absolute path without quotes."
  }
}

variable "command" {
  description = "argv of the process (exec'd in a session of its own)"
  type        = list(string)
}

variable "environment" {
  description = "environment added to Terraform's own for the process"
  type        = map(string)
  default     = {}
  sensitive   = true
}

variable "ready_command" {
  description = "shell command that succeeds once the process serves; empty: alive after 1 s"
  type        = string
  default     = ""
}

variable "ready_timeout_s" {
  description = "seconds the process has to become ready before the apply fails (and it is stopped)"
  type        = number
  default     = 120
}

variable "stop_timeout_s" {
  description = "seconds between SIGTERM and SIGKILL at destroy"
  type        = number
  default     = 15
}

variable "config_file" {
  description = "absolute path of a file written before the start (empty: none)"
  type        = string
  default     = ""
}

variable "config_content" {
  description = "content of config_file"
  type        = string
  default     = ""
}
