"""retained"""
