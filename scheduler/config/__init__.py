"""Engine configuration: the frozen configs, speculative decoding's config, environment switches, value checks."""
