#!/bin/sh
# in_tree.sh TREE COMMAND...: runs a compile inside its header closure, a tree artifact holding
# the source and the headers it reads at their execution-root paths (docs/header-closure.md).
# A script, not run_shell: the shell's own path would be a word of every compile's key.
cd "$1" && shift && exec "$@"
