"""Bazel-side tests: real Bazel, nvcc, nginx and BuildGrid in temporary copies of the workspace."""
