"""The policy file: schema, loading with precise errors, and the runtime view the gateway uses."""
