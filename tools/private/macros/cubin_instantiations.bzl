"""cubin_instantiations: one cuda_cubin target per point of an instantiation matrix."""

load("//tools/private:types.bzl", "check_ptx_arch")
load("//tools/private/rules:cubin_family.bzl", "cubin_family")
load("//tools/private/rules:cubin_jit_template.bzl", "cubin_jit_template")
load("//tools/private/rules:cubin_tu.bzl", "cubin_tu")
load("//tools/private/rules:cuda_cubin.bzl", "cuda_cubin")
load("//tools/private/rules:cuda_ptx.bzl", "cuda_ptx")
load(":warm_grid.bzl", "warm_grid")

_GEOMETRY_KEYS = ["block", "shared_mem", "cluster", "grid"]

def _render(key, value):
    """A parameter value as it appears in ids and target names: 'f32', or 'vec4' for an int."""
    if type(value) == "int":
        return "{}{}".format(key, value)
    if type(value) == "string" and value and value.replace("_", "a").isalnum():
        return value
    fail("cubin_instantiations: grid value {} of '{}' must be an int or an alphanumeric string".format(repr(value), key))

def _product(grid):
    """The cartesian product of one grid, in grid order, as a list of dicts."""
    points = [{}]
    for key, values in grid.items():
        if not values:
            fail("cubin_instantiations: grid key '{}' has no values".format(key))
        points = [dict(p.items() + [(key, v)]) for p in points for v in values]
    return points

def _points(grid):
    """The points of a grid, or of a list of grids (the union of their products).

    Every grid of a list must have the same keys in the same order, so that ids stay
    comparable within the family.
    """
    grids = grid if type(grid) == "list" else [grid]
    keys = grids[0].keys()
    points = []
    for g in grids:
        if g.keys() != keys:
            fail("cubin_instantiations: every grid must have the keys {} in this order, got {}".format(keys, g.keys()))
        points.extend(_product(g))
    return points

def _placeholders(text):
    """The `{name}` placeholders of a string, in order.

    Only braces around an identifier are one, so C++ such as `{0}` or `{ x, y }` is not.
    """
    found = []
    for piece in text.split("{")[1:]:
        if "}" not in piece:
            continue
        word = piece.partition("}")[0]
        if word and not word[0].isdigit() and word.replace("_", "a").isalnum():
            found.append(word)
    return found

def _strings(value):
    """Every string of an attribute value: itself, a list's items, a dict's keys and values.

    Starlark has no recursion; three levels hold `launch`'s entry -> key -> list of rules.
    """
    strings = []
    pending = [value]
    for _ in range(4):
        nested = []
        for v in pending:
            if type(v) == "string":
                strings.append(v)
            elif type(v) == "list":
                nested.extend(v)
            elif type(v) == "dict":
                nested.extend(v.keys())
                nested.extend(v.values())
        pending = nested
    return strings

def _check_placeholders(name, attributes, keys):
    """Fails naming the attribute and the placeholder when one is no grid key.

    A typo would otherwise reach nvcc as text (`-DBLOCK={blok}`).
    """
    for attribute, value in attributes.items():
        for text in _strings(value):
            for word in _placeholders(text):
                if word not in keys:
                    fail("cubin_instantiations '{}': attribute '{}' has placeholder '{{{}}}' in {}, which is not a grid key; grid keys: {}".format(
                        name,
                        attribute,
                        word,
                        repr(text),
                        ", ".join(["'{" + k + "}'" for k in keys]),
                    ))

def _fill(template, params):
    """`template` with each `{key}` of `params` replaced; other braces are left alone."""
    for key, value in params.items():
        template = template.replace("{" + key + "}", str(value))
    return template

def _fill_one(value, params):
    return _fill(value, params) if type(value) == "string" else value

def _fill_value(value, params):
    """A geometry value (an int, a string, or a list of them) with placeholders filled."""
    if type(value) == "list":
        return [_fill_one(v, params) for v in value]
    return _fill_one(value, params)

def _launch_for(launch, entries, params):
    """Per entry, the launch geometry with the point's values filled in (JSON)."""
    if not launch:
        return "{}"
    if any([k in launch for k in _GEOMETRY_KEYS]):
        per_entry = {entry: launch for entry in entries}
    else:
        per_entry = launch
    out = {}
    for entry, geometry in per_entry.items():
        for key in geometry:
            if key not in _GEOMETRY_KEYS:
                fail("cubin_instantiations: launch key '{}' of entry '{}'; allowed: {}".format(key, entry, ", ".join(_GEOMETRY_KEYS)))
        out[_fill(entry, params)] = {k: _fill_value(v, params) for k, v in geometry.items()}
    return json.encode(out)

def _optional(**attrs):
    """The attributes given a value (None: the rule's default)."""
    return {k: v for k, v in attrs.items() if v != None}

def cubin_instantiations(
        name,
        grid,
        archs,
        entries,
        srcs = [],
        src_template = None,
        hdrs = [],
        deps = [],
        defines = [],
        copts = [],
        launch = {},
        family = None,
        toolkit_headers = None,
        header_closure = None,
        jit = False,
        warm_points = [],
        ptx = [],
        visibility = None):
    """Expands an instantiation matrix into one cuda_cubin per (grid point, arch).

    Target `<name>_<v1>_<v2>..._<arch>` is made for every point (and each `ptx` arch), where each value renders as
    itself (strings) or as `<key><value>` (ints): `axpy_f32_vec4_sm_90a`. Its manifest id is
    `<family>/<v1>/<v2>.../<arch>`. Target `<name>` (a cubin_family) groups them all. With
    `src_template`, target `<name>_<v1>_<v2>..._tu` renders each point's translation unit
    (`<name>_<v1>_<v2>....cu`).

    `{param}` placeholders are filled per point in `src_template`'s text, `hdrs`, `defines`,
    `copts`, `entries` (names and types) and `launch`. In those attributes (not in the
    template's text, which loading cannot read) a `{word}` that is no grid key fails loading,
    naming the attribute.

    Args:
      name: family target name and prefix of every instantiation target.
      grid: dict of parameter name -> list of values (ints or strings), in id order; or a
        list of such dicts with the same keys, for matrices that are not one cartesian product.
      archs: architectures to build each point for, e.g. ["sm_90a", "sm_80"].
      entries: dict of entry -> parameter types. An entry is an extern "C" name, a mangled
        symbol, or a C++ name as the library writes it (`ns::gemm<{bm}, {bn}>`), which the
        manifest action resolves to its symbol in the CUBIN.
      srcs: the one .cu translation unit shared by every point (or use `src_template`).
      src_template: a .cu template rendered per point, the pattern JIT libraries generate.
      hdrs: headers the source includes; entries with placeholders make per-point header
        sets, so a header change re-keys only the points that include it.
      deps: cuda_headers targets.
      defines: preprocessor defines.
      copts: extra nvcc flags; `-std=...` or `-O<n>` replace the defaults.
      launch: launch geometry for every entry (`block`, `shared_mem`, `cluster`, `grid`), or
        a dict entry -> geometry. `shared_mem`, `block` and `cluster` may be integer
        arithmetic over placeholders; `grid` items may also use `args[i]`, `sm_count`,
        `cdiv`, `min` and `max`, evaluated at launch.
      family: family name in the manifest; defaults to `name`.
      toolkit_headers: the toolkit's optional header sets the sources include (cuda_cubin's
        attribute: 'libcudacxx', 'cub', 'thrust', or [] for the core headers alone); None
        (default): the whole include tree.
      header_closure: cuda_cubin's attribute: None or True (the default) compiles each point
        from the headers its source includes, so a header a point never includes re-keys none
        of its targets; False declares every header of hdrs and deps instead.
      jit: also write the family's JIT template (target `<name>_jit`, a cubin_jit_template of
        the same sources, defines, copts and entries), which the manifest embeds, so the
        runtime can compile points the grid lacks. Entries must then be symbols.
      warm_points: points met at run time that no release had, built besides the grid's (the
        family's export: `load(":warmset.bzl", "WARM_POINTS")`, written by `cubinstore warmset
        export --family <family>`). Each must have the grid's keys.
      ptx: PTX targets to ship besides the CUBINs, e.g. ["compute_90"]: one `cuda_ptx` per point
        and arch (mnemonic PtxCompile), in the manifest as a kernel of that arch. The runtime loads
        PTX only where no CUBIN of the point runs on the device, and the driver compiles it then;
        plain `compute_XY` runs on X.Y and every newer GPU, `compute_XYa` on X.Y alone.
      visibility: visibility of the family target.
    """
    if (src_template == None) == (not srcs):
        fail("cubin_instantiations '{}': give exactly one of 'srcs' and 'src_template'".format(name))
    keys = (grid if type(grid) == "list" else [grid])[0].keys()
    _check_placeholders(
        name,
        {"hdrs": hdrs, "defines": defines, "copts": copts, "entries": entries, "launch": launch},
        keys,
    )
    family = family or name
    for arch in ptx:
        check_ptx_arch("cubin_instantiations '{}': attribute 'ptx'".format(name), arch)
    if warm_points:
        grid = warm_grid(grid, warm_points)
    instances = []
    for params in _points(grid):
        rendered = [_render(k, v) for k, v in params.items()]
        point = "_".join([name] + rendered)
        point_srcs = srcs
        if src_template != None:
            cubin_tu(
                name = point + "_tu",
                template = src_template,
                substitutions = {"{" + k + "}": str(v) for k, v in params.items()},
                out = point + ".cu",
            )
            point_srcs = [":" + point + "_tu"]
        point_entries = {
            _fill(entry, params): [_fill(t, params) for t in types]
            for entry, types in entries.items()
        }

        # A CUBIN per arch, then a PTX per `ptx` arch: the same attributes, another rule.
        for rule, rule_archs in ((cuda_cubin, archs), (cuda_ptx, ptx)):
            for arch in rule_archs:
                target = point + "_" + arch
                rule(
                    name = target,
                    srcs = point_srcs,
                    hdrs = [_fill(h, params) for h in hdrs],
                    deps = deps,
                    arch = arch,
                    family = family,
                    id = "/".join([family] + rendered + [arch]),
                    params_json = json.encode(params),
                    defines = [_fill(d, params) for d in defines],
                    copts = [_fill(c, params) for c in copts],
                    entries = point_entries,
                    launch_json = _launch_for(launch, entries, params),
                    **_optional(toolkit_headers = toolkit_headers, header_closure = header_closure)
                )
                instances.append(":" + target)
    jit_template = None
    if jit:
        if any(["{" in h for h in hdrs]):
            fail("cubin_instantiations '{}': jit = True needs one header set for every point, 'hdrs' has placeholders".format(name))
        jit_template = ":" + name + "_jit"
        cubin_jit_template(
            name = name + "_jit",
            family = family,
            grid_keys = _points(grid)[0].keys(),
            src = src_template if src_template != None else srcs[0],
            hdrs = hdrs,
            deps = deps,
            defines = defines,
            copts = copts,
            entries = entries,
            archs = archs,
        )
    cubin_family(name = name, instances = instances, jit_template = jit_template, visibility = visibility)
