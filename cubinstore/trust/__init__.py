"""Signed release channels: records, the accept/refuse decision (pure), the channel I/O, signing."""
