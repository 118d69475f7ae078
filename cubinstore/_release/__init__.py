"""Moving releases: manifest references, prefetch, offline bundles, publish, maintenance, the warm set."""
