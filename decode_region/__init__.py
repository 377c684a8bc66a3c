"""prfaas.decode_region"""
