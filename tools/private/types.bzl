"""Vocabulary shared by the rules: parameter types and target architectures."""

# Kernel parameter types and their (size, alignment) in bytes on the device.
PARAM_TYPES = {
    "i32": (4, 4),
    "u32": (4, 4),
    "i64": (8, 8),
    "u64": (8, 8),
    "f32": (4, 4),
    "f64": (8, 8),
    "ptr": (8, 8),
    "tensormap": (128, 64),
}

def check_arch(label, arch):
    """Fails unless `arch` is `sm_<major><minor>` with an optional `a` suffix.

    Args:
      label: the target, for the error message.
      arch: the value of its `arch` attribute.
    """
    digits = arch[3:-1] if arch.endswith("a") else arch[3:]
    if not arch.startswith("sm_") or len(digits) < 2 or not digits.isdigit():
        fail("{}: attribute 'arch' must look like 'sm_80' or 'sm_90a', got '{}'".format(label, arch))

def check_entries(label, entries):
    """Fails unless every entry is a C identifier with known parameter types.

    Args:
      label: the target, for the error message.
      entries: the value of its `entries` attribute.
    """
    if not entries:
        fail("{}: attribute 'entries' must name at least one entry symbol".format(label))
    for name, types in entries.items():
        if not name or name[0].isdigit() or not name.replace("_", "a").isalnum():
            fail("{}: entry '{}' in attribute 'entries' is not a C identifier".format(label, name))
        for t in types:
            if t not in PARAM_TYPES:
                fail("{}: entry '{}' has parameter type '{}'; allowed: {}".format(
                    label,
                    name,
                    t,
                    ", ".join(PARAM_TYPES.keys()),
                ))
