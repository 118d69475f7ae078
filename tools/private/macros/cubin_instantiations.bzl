"""cubin_instantiations: one cuda_cubin target per point of an instantiation matrix."""

load("//tools/private/rules:cubin_family.bzl", "cubin_family")
load("//tools/private/rules:cuda_cubin.bzl", "cuda_cubin")

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

def _fill(template, params):
    return template.format(**params)

def cubin_instantiations(
        name,
        srcs,
        grid,
        archs,
        entries,
        hdrs = [],
        deps = [],
        defines = [],
        copts = [],
        family = None,
        visibility = None):
    """Expands an instantiation matrix into one cuda_cubin per (grid point, arch).

    Target `<name>_<v1>_<v2>..._<arch>` is made for every point, where each value renders as
    itself (strings) or as `<key><value>` (ints): `axpy_f32_vec4_sm_90a`. Its manifest id is
    `<family>/<v1>/<v2>.../<arch>`. Target `<name>` (a cubin_family) groups them all.

    Args:
      name: family target name and prefix of every instantiation target.
      srcs: the one .cu translation unit.
      grid: dict of parameter name -> list of values (ints or strings), in id order; or a
        list of such dicts with the same keys, for matrices that are not one cartesian product.
      archs: architectures to build each point for, e.g. ["sm_90a", "sm_80"].
      entries: dict of entry symbol -> parameter types; `{param}` placeholders are filled per point.
      hdrs: headers the source includes.
      deps: cuda_headers targets.
      defines: preprocessor defines; `{param}` placeholders are filled per point.
      copts: extra nvcc flags; `{param}` placeholders are filled per point.
      family: family name in the manifest; defaults to `name`.
      visibility: visibility of the family target.
    """
    family = family or name
    instances = []
    for params in _points(grid):
        rendered = [_render(k, v) for k, v in params.items()]
        for arch in archs:
            target = "_".join([name] + rendered + [arch])
            cuda_cubin(
                name = target,
                srcs = srcs,
                hdrs = hdrs,
                deps = deps,
                arch = arch,
                family = family,
                id = "/".join([family] + rendered + [arch]),
                params_json = json.encode(params),
                defines = [_fill(d, params) for d in defines],
                copts = [_fill(c, params) for c in copts],
                entries = {
                    _fill(entry, params): [_fill(t, params) for t in types]
                    for entry, types in entries.items()
                },
            )
            instances.append(":" + target)
    cubin_family(name = name, instances = instances, visibility = visibility)
