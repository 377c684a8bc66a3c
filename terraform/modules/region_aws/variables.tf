variable "region" {
  description = "the region interface: an object typed and defaulted by modules/region_config (docs/deploy.md); here gpu_type defaults to l40s and dtype to bfloat16"
  type        = any
}

variable "control_plane_url" {
  description = "gRPC target of the control plane's registry (host:port): a control_plane_* module's registry_target"
  type        = string
}

# --- AWS only ----------------------------------------------------------------------------

variable "ticket_key_secret_arn" {
  description = "Secrets Manager ARN (in this AWS region) of the ticket key (control_plane_aws creates it)"
  type        = string
}

variable "ticket_key_kms_arn" {
  description = "KMS key ARN encrypting that secret (empty: the AWS-managed key)"
  type        = string
  default     = ""
}

variable "tls_secret" {
  description = "the region's mutual-TLS material: a Secrets Manager secret holding JSON {\"ca\", \"cert\", \"key\"} (PEM text) from `prfaas certs init --identity prfaas://ROLE/NAME/*`, created by the operator so that no private key passes through Terraform (docs/deploy.md, \"Certificates\")"
  type        = any # {arn, kms_arn}: typed, defaulted and checked once, in modules/tls_secret
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
  description = "tags on every resource of the region"
  type        = map(string)
  default     = {}
}
