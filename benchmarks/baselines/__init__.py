"""Baselines Leto is measured against on the same harness (DESIGN.md section 2.7): full restarts."""
