"""The run's plan: the config read with file and line (config_file), checked and resolved into each dataset's
shard plan and each stage's settings (resolve), and each rule's environment (environments)."""
