"""warm_grid: a family's grid plus the warm points it lacks (the one definition).

`cubinstore warmset export --family F` writes only the points (`kernels/F/warmset.bzl`'s
`WARM_POINTS`, data); `cubin_instantiations(..., warm_points = WARM_POINTS)` passes its grid
through `warm_grid`, so every family uses this one copy.
"""

def _in_grids(point, grids):
    for g in grids:
        inside = True
        for k, values in g.items():
            if point[k] not in values:
                inside = False
        if inside:
            return True
    return False

def warm_grid(grid, points):
    """The family's grid plus each warm point it lacks.

    Args:
      grid: the family's grid: a dict of parameter -> values, or a list of such dicts.
      points: the warm points, each a dict of parameter -> value.

    Returns:
      A list of grids: `grid`'s, then one single-point grid per missing point.
    """
    grids = grid if type(grid) == "list" else [grid]
    keys = grids[0].keys()
    out = list(grids)
    for p in points:
        if sorted(p.keys()) != sorted(keys):
            fail("warmset.bzl: point {} has keys {}, the family's grid has {}; export again".format(p, sorted(p.keys()), keys))
        if not _in_grids(p, out):
            out.append({k: [p[k]] for k in keys})
    return out
