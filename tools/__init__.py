"""The repository's tools (not part of the curvopt library): the GPU work in tools/gpu/, cfg_walk."""
