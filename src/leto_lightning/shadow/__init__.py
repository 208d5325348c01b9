"""shadow"""
