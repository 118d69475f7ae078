"""Facts, defined once, that every layer above uses; imports nothing of cubinstore but ``errors``.

``abi`` (parameter types, the layout rule and its one comparison, ``Arch``, ids, names, limits,
canonical and strict JSON), ``cubin`` (the CUBIN ELF reader), ``geometry`` (launch rules),
``nvcc`` (the shape of nvcc's command line), ``digest`` (``Digest`` and the one sha256 check),
``text`` (how values appear in messages), ``knobs`` (every ``CUBINSTORE_*`` variable), ``log``,
and ``userfile`` (opening a file a user named: the one filesystem access here).
"""
