output "pid_file" {
  description = "RUN_DIR/NAME.pid: \"PID STARTTIME\" while the process runs"
  value       = "${var.run_dir}/${var.name}.pid"
  depends_on  = [terraform_data.process]
}

output "log_file" {
  description = "the process's stdout and stderr"
  value       = "${var.run_dir}/${var.name}.log"
  depends_on  = [terraform_data.process]
}
