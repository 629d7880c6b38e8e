"""Checks of the file itself: it parses, decodes and matches what was published (forensics, verify,
manifest, diff, plausibility of its metadata, tensor-parallel sharding of its weights)."""
