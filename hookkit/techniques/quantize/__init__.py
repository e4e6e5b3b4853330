"""techniques/quantize"""
