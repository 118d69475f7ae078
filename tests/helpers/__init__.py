"""The one test helper package: what several test areas share.

``blobs`` (CUBIN-like blobs, manifests, disk caches), ``manifest_paths`` (paths into the built
release), ``net`` (misbehaving HTTP servers on loopback), ``jit`` (a small library and TU for
the JIT, child processes), ``gpu`` (GPU detection and the manifest under test), ``scale``
(synthetic releases of thousands of kernels). Tests import these as ``helpers.<name>``;
``tests/conftest.py`` puts ``tests/`` on the import path.
"""
