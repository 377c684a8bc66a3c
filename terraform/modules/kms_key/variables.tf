variable "description" {
  description = "what the key encrypts"
  type        = string
}

variable "autoscaling_ebs" {
  description = "let the Auto Scaling service-linked role use the key (encrypted EBS volumes of an ASG)"
  type        = bool
  default     = false
}

variable "log_groups" {
  description = "CloudWatch log groups to create, encrypted with the key: name by key (keys known at plan time)"
  type        = map(string)
  default     = {}
}

variable "log_retention_days" {
  description = "retention of those log groups, days"
  type        = number
  default     = 365
}

variable "tags" {
  description = "tags on the key and its log groups"
  type        = map(string)
  default     = {}
}
