"""A run's settings: the RunConfig tree and validate (config), the command line
(arguments, with Megatron-LM's flags and aliases: megatron_flags, megatron_aliases),
the YAML file (yaml_config, int_lists) and the checks that would otherwise fail late
(run_checks)."""
