"""Files that run inside the guest (the scenario) or are baked into its image."""
