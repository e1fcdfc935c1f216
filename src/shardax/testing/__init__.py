"""Testing helpers."""
