"""techniques/compile"""
