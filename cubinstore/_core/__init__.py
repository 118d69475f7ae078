"""Facts with no I/O: types and layouts, digests, knobs, logging. Imports nothing above it."""
