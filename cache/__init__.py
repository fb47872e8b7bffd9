"""Response cache: exact and semantic matching, tenant-scoped, quality-gated."""
