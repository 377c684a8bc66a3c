variable "region" {
  description = "the region interface: an object typed and defaulted by modules/region_config (docs/deploy.md); here gpu_type defaults to l40s and dtype to bfloat16"
  type        = any
}

variable "control_plane_url" {
  description = "gRPC target of the control plane's registry (host:port): a control_plane_* module's registry_target"
  type        = string
}

# --- AWS only ----------------------------------------------------------------------------

variable "tls_secret" {
  description = "the region's mutual-TLS material: a Secrets Manager secret holding JSON {\"ca\", \"cert\", \"key\"} (PEM text) from `prfaas certs init --identity prfaas://ROLE/NAME/*`, created by the operator so that no private key passes through Terraform (docs/deploy.md, \"Certificates\")"
  type        = any # {arn, kms_arn}: typed, defaulted and checked once, in modules/tls_secret
}

variable "ticket_key_secret" {
  description = "the ticket key's Secrets Manager secret in this AWS region (control_plane_aws creates it, and its replicas): {arn, kms_arn}"
  type = object({
    arn     = string
    kms_arn = optional(string, "") # the KMS key encrypting it; empty: the AWS-managed aws/secretsmanager key
  })
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
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
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

variable "capacity" {
  description = "the auto-scaling group: GPU instance types, first preferred (the spot pool draws from all), its sizes, and how many instances are on demand (the rest is spot)"
  type = object({
    instance_types          = optional(list(string), ["g6e.xlarge", "g6e.2xlarge"])
    min_size                = optional(number, 1)
    max_size                = optional(number, 4)
    desired_capacity        = optional(number, 1)
    on_demand_base_capacity = optional(number, 1) # instances always on demand
    on_demand_percentage    = optional(number, 0) # on-demand share above the base, percent
  })
  default = {}
  validation {
    condition     = length(var.capacity.instance_types) > 0
    error_message = "capacity.instance_types needs at least one type."
  }
}

variable "enable_efa" {
  description = "EFA network interface and a cluster placement group (in-region RDMA); the group lies in one availability zone, so the region's instances must too"
  type        = bool
  default     = false
  # a cluster placement group cannot span availability zones: an auto-scaling group over
  # subnets of two would fail its launches in the other
  validation {
    condition     = !var.enable_efa || length(var.vpc.id == "" ? var.vpc.availability_zones : var.vpc.private_subnet_ids) == 1
    error_message = "enable_efa: a cluster placement group is in one availability zone; give the region exactly one (vpc.availability_zones, or one subnet in vpc.private_subnet_ids)."
  }
}

variable "ready_timeout_s" {
  description = "seconds a new instance has, from its launch, to serve (cloud-init's installs, the model's preparation and load); past it the auto-scaling group abandons it (terminates it and launches another). The launch lifecycle hook's heartbeat timeout"
  type        = number
  default     = 1800
  validation {
    condition     = var.ready_timeout_s >= 30 && var.ready_timeout_s <= 7200 && floor(var.ready_timeout_s) == var.ready_timeout_s
    error_message = "ready_timeout_s: whole seconds from 30 to 7200 (AWS's range of a lifecycle hook's timeout)."
  }
}

variable "vpc" {
  description = "the region's network: a VPC created with `cidr` (a private and a public subnet in each of `availability_zones`, the public ones holding only NAT gateways), or an existing one by `id`, with its `cidr` and the `private_subnet_ids` of the instances (with a NAT route)"
  type = object({
    id                 = optional(string, "")             # an existing VPC; empty: create one
    cidr               = optional(string, "10.10.0.0/16") # of the created VPC, or the existing one's
    private_subnet_ids = optional(list(string), [])       # the existing VPC's subnets for the instances
    availability_zones = optional(list(string), [])       # a created VPC's, named (a fixed set: a new AZ never appears by itself)
  })
  default = {}
}

variable "cidrs" {
  description = "the networks the region's security group opens to, by peer: `control_plane` (gRPC in; registry heartbeats out), `peers`, the peer regions (KV ingress (decode role) / egress (prefill role), gRPC both ways), `metrics` (allowed to scrape /metrics)"
  type = object({
    control_plane = list(string)
    peers         = optional(list(string), [])
    metrics       = optional(list(string), [])
  })
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
