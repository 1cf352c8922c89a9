"""Loading what the user points ampaudit at: a model file, its entry point, example inputs."""
