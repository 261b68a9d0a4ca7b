"""Optional compiled CPU kernels (filled in by ``load()``); None means use the torch fallback."""

paged_decode = None
