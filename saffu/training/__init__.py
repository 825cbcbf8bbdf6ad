"""Training: the one trainer of every model, warm or cold start (``trainer``), run directories
with their configs, explicit solutions and checkpoints (``checkpoints``), and the recipes that
put a model to train together from solved pieces (``recipes``)."""
