"""Training: the one trainer of every model, warm or cold start (``trainer``), and run
directories with their configs, explicit solutions and checkpoints (``checkpoints``)."""
