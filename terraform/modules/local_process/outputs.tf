# read from the resource (its `input`), so that whoever reads them waits for the process
output "pid_file" {
  description = "RUN_DIR/NAME.pid: \"PID STARTTIME\" while the process runs"
  value       = "${terraform_data.process.input.run_dir}/${terraform_data.process.input.name}.pid"
}

output "log_file" {
  description = "the process's stdout and stderr"
  value       = "${terraform_data.process.input.run_dir}/${terraform_data.process.input.name}.log"
}
