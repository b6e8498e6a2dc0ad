"""Test-only helpers, imported as ``support`` (tests/ is on sys.path through its conftest.py)."""
