#!/usr/bin/env python3
"""Writes a family's JIT template and its source bundle (the CubinJitTemplate action).

The bundle (schema cubinstore/jit-sources/v1) holds the family's TU (or TU template) and
headers by workspace path; it is an action output, so Bazel's caches keep it under its
sha256 like any CUBIN and the runtime fetches it by digest. The template (schema
cubinstore/jit-family/v1) names the bundle by the digest computed here from the written
bytes, and is validated by the runtime's own parser (`cubinstore._jit.family`).

Usage: jit_template_tool.py SPEC.json TEMPLATE.json SOURCES.json
SPEC.json: {"family", "grid_keys", "source", "files", "defines", "copts", "includes",
            "entries", "archs", "package"}
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

# Under Bazel the package's sources are inputs at their workspace paths below the working
# directory (the execution root); run by hand, they are beside this script's directory.
for _root in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.realpath(__file__)))):
    if os.path.isfile(os.path.join(_root, "cubinstore", "_jit", "family.py")):
        sys.path.insert(0, _root)
        break

# _jit.family directly, not through cubinstore.internals (the tests' and benchmarks' door) or the
# public cubinstore.jit: this action runs under the host's python3, without the xxhash that both
# import with the JIT's key (tests/project/test_internals.py lists this import).
from cubinstore._jit.family import TEMPLATE_SCHEMA, FamilyTemplate, make_bundle  # noqa: E402
from cubinstore.errors import CubinstoreError  # noqa: E402
from cubinstore.manifest import dumps_canonical  # noqa: E402


def main(spec_path: str, template_path: str, bundle_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    files = {}
    for path in spec["files"]:
        with open(path, encoding="utf-8") as f:
            files[path] = f.read()
    try:
        bundle = make_bundle(files)
        doc = {
            "schema": TEMPLATE_SCHEMA,
            "family": spec["family"],
            "grid_keys": spec["grid_keys"],
            "source": spec["source"],
            "bundle": {"digest": "sha256:" + hashlib.sha256(bundle).hexdigest(), "size": len(bundle)},
            "defines": spec["defines"],
            "copts": spec["copts"],
            "includes": spec["includes"],
            "entries": spec["entries"],
            "archs": spec["archs"],
            "package": spec["package"],
        }
        FamilyTemplate.from_json(doc, f"JIT template of family {spec['family']!r}")
    except CubinstoreError as exc:
        print(f"jit_template_tool: {exc}", file=sys.stderr)
        return 1
    with open(bundle_path, "wb") as f:
        f.write(bundle)
    with open(template_path, "wb") as f:
        f.write(dumps_canonical(doc))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__.strip().splitlines()[-3], file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(*sys.argv[1:]))
