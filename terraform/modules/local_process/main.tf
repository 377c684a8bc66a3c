# One long-running process on this host, started at create and stopped at destroy by
# procctl.sh (PID file + process start time, so a reused PID is never signalled).
# Only the built-in terraform_data resource: nothing to download, so `terraform init` works
# offline. Changing any input replaces the resource: the old process is stopped first.

terraform {
  required_version = ">= 1.4"
}

locals {
  procctl = "${abspath(path.module)}/procctl.sh"
  quoted  = [for arg in var.command : format("'%s'", replace(arg, "'", "'\\''"))]
  start = join(" ", concat(
    [local.procctl, "start", var.name, format("'%s'", var.run_dir), tostring(var.ready_timeout_s)],
    [format("'%s'", replace(var.ready_command, "'", "'\\''")), "--"],
    local.quoted,
  ))
}

resource "terraform_data" "process" {
  triggers_replace = [local.start, var.environment, var.config_content, var.config_file]

  # everything the destroy-time provisioner needs (it can read only `self`)
  input = {
    name           = var.name
    run_dir        = var.run_dir
    stop_timeout_s = var.stop_timeout_s
    procctl        = local.procctl
  }

  provisioner "local-exec" {
    # the file's content travels in the environment, so no character needs quoting
    command     = var.config_file == "" ? "true" : "mkdir -p \"$(dirname \"$PRFAAS_TF_FILE\")\" && printf '%s' \"$PRFAAS_TF_CONTENT\" > \"$PRFAAS_TF_FILE\""
    environment = { PRFAAS_TF_FILE = var.config_file, PRFAAS_TF_CONTENT = var.config_content }
  }

  provisioner "local-exec" {
    command     = local.start
    environment = var.environment
  }

  provisioner "local-exec" {
    when    = destroy
    command = "'${self.input.procctl}' stop '${self.input.name}' '${self.input.run_dir}' ${self.input.stop_timeout_s}"
  }
}
