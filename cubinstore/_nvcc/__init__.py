"""``cubinstore-nvcc``, the drop-in nvcc: ``argv`` (which calls it caches), ``calls`` and ``hit``
(answering a call from its record), ``miss`` (the remote, else a compile through the JIT),
``probes`` (what a record checks besides the files read), ``remote`` (records in a remote's
action cache), ``warm`` (misses kept for ``warmset export``), ``real`` (the real nvcc), ``main``."""
