"""From the composed Hydra config to the checked, typed job (``checks.check_config``): every run's checks, the
schema of every option, building the net, the strategy and the job, resolvers, and the command line's overrides."""
