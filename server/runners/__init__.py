"""Runners: what serves one loaded model version behind the `Runner` protocol (see base.py)."""
