"""Baselines Leto is measured against on the same harness (docs/design.md section 2.7): full restarts."""
