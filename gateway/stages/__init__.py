"""The stages of a request that can end it early or change its targets: cache, tiers."""
