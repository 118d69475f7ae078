"""Moving releases: prefetch, offline bundles, maintenance, the warm set."""
