"""prfaas.prefill_region"""
