"""Signed release channels."""
