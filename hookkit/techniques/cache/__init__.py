"""techniques/cache"""
