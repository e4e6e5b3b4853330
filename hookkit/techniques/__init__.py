"""techniques"""
