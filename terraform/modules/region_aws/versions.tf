terraform {
  # 1.9: a variable's validation may read another variable (enable_efa reads vpc)
  required_version = ">= 1.9"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40"
    }
  }
}
