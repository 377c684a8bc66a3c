"""prfaas.region"""
