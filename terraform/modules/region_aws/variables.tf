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
  default     = "l40s"
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

# --- AWS only ----------------------------------------------------------------------------

variable "ticket_key_secret_arn" {
  description = "Secrets Manager ARN (in this AWS region) of the ticket key (control_plane_aws creates it)"
  type        = string
}

variable "dtype" {
  description = "engine dtype on the GPU"
  type        = string
  default     = "bfloat16"
}

variable "ticket_key_kms_arn" {
  description = "KMS key ARN encrypting that secret (empty: the AWS-managed key)"
  type        = string
  default     = ""
}

variable "registry_port" {
  description = "the control plane registry's gRPC port (heartbeats go out to it)"
  type        = number
  default     = 7000
}

variable "prfaas_package" {
  description = "pip requirement cloud-init installs, e.g. prfaas[vllm]==0.1.0"
  type        = string
  default     = "prfaas"
}

variable "ami_id" {
  description = "GPU AMI; empty: the latest AWS Deep Learning Base AMI from SSM (ami_ssm_parameter)"
  type        = string
  default     = ""
}

variable "ami_ssm_parameter" {
  description = "SSM parameter holding the GPU AMI id"
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
}

variable "root_device_name" {
  description = "root device of the AMI"
  type        = string
  default     = "/dev/sda1"
}

variable "root_volume_gb" {
  description = "encrypted gp3 root volume size"
  type        = number
  default     = 200
}

variable "instance_types" {
  description = "GPU instance types, first preferred (the spot pool draws from all)"
  type        = list(string)
  default     = ["g6e.xlarge", "g6e.2xlarge"]
  validation {
    condition     = length(var.instance_types) > 0
    error_message = "instance_types needs at least one type."
  }
}

variable "min_size" {
  description = "ASG minimum instances"
  type        = number
  default     = 1
}

variable "max_size" {
  description = "ASG maximum instances"
  type        = number
  default     = 4
}

variable "desired_capacity" {
  description = "ASG desired instances"
  type        = number
  default     = 1
}

variable "on_demand_base_capacity" {
  description = "instances always on demand"
  type        = number
  default     = 1
}

variable "on_demand_percentage" {
  description = "on-demand share above the base, percent (the rest is spot)"
  type        = number
  default     = 0
}

variable "enable_efa" {
  description = "EFA network interface and a cluster placement group (in-region RDMA)"
  type        = bool
  default     = false
}

variable "vpc_id" {
  description = "an existing VPC; empty: create one with vpc_cidr"
  type        = string
  default     = ""
}

variable "vpc_cidr" {
  description = "CIDR of the created VPC, or of the existing one"
  type        = string
  default     = "10.10.0.0/16"
}

variable "private_subnet_ids" {
  description = "subnets of the existing VPC for the instances (with a NAT route)"
  type        = list(string)
  default     = []
}

variable "availability_zones" {
  description = "availability zones of a created VPC, named (a fixed set: a new AZ never appears by itself)"
  type        = list(string)
  default     = []
}

variable "peer_cidrs" {
  description = "CIDRs of peer regions: KV ingress (decode role) / egress (prefill role), gRPC both ways"
  type        = list(string)
  default     = []
}

variable "control_plane_cidrs" {
  description = "CIDRs of the control plane (gRPC in; registry heartbeats out)"
  type        = list(string)
}

variable "metrics_cidrs" {
  description = "CIDRs allowed to scrape /metrics"
  type        = list(string)
  default     = []
}

variable "log_retention_days" {
  description = "CloudWatch retention of region and flow logs"
  type        = number
  default     = 365
}

variable "tags" {
  description = "tags on every resource"
  type        = map(string)
  default     = {}
}
