"""Run-time compilation below the public ``cubinstore.jit``: key, direct key, index, family templates, flags, explain."""
