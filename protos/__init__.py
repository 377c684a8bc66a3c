"""prfaas.protos"""
