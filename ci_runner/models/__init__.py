"""Models and their inputs: loading (config, checkpoint, zoo), fast init, synthetic inputs, module trees."""
