# The root pins Terraform and the providers' upper bounds; the modules state only the lowest
# provider versions they need.
terraform {
  required_version = ">= 1.9" # modules/region_aws's validations
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
    random = {
      source  = "hashicorp/random"
      version = ">= 3.5, < 4.0"
    }
  }
}

# One provider per AWS region: prefill in two regions with cheap compute-dense GPUs, decode
# (and the control plane) in a third.
provider "aws" {
  alias  = "prefill_a"
  region = var.regions.prefill_a.aws_region
  default_tags {
    tags = var.tags
  }
}

provider "aws" {
  alias  = "prefill_b"
  region = var.regions.prefill_b.aws_region
  default_tags {
    tags = var.tags
  }
}

provider "aws" {
  alias  = "decode"
  region = var.regions.decode.aws_region
  default_tags {
    tags = var.tags
  }
}
