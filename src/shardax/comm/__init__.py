"""Collectives inside smap."""
