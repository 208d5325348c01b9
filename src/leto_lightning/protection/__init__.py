"""protection"""
