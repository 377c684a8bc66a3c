"""prfaas.sim"""
