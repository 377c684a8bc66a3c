"""prfaas.loadgen"""
