"""OCI registries as store layers: ``oci://HOST[:PORT]/REPO`` (``remote.OciLayer``) and an
``oci:`` layout directory that ``skopeo copy`` writes (``layout.OciLayout``).

``reference`` parses the URL grammar, ``client`` speaks the distribution protocol over
``HttpLayer``'s connections and deadlines, ``auth`` reads credentials and challenges,
``artifact`` is the format of a release (and a channel pointer) as an OCI artifact.
"""
