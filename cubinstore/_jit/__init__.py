"""Run-time compilation below the public ``cubinstore.jit``: compiler, key, direct key, index, family points, explain."""
