"""The local store: the CAS on disk, the descriptor-safe file API below it, its locks."""
